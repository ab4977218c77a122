"""Customer pages. Reads go through the selectors; every action (advise, book, stop, tokens) is
a call from the page to the REST API with the session, so the browser gets exactly the
validation and the errors a program gets."""

from __future__ import annotations

from urllib.parse import urlencode

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from accounts.selectors import secret_list
from accounts.tenancy import request_team, team_page
from marketplace import lifecycle, selectors
from marketplace.api.serializers import OfferQuerySerializer
from marketplace.models import CLUSTER_GBPS_MAX, Interconnect, RentalStatus
from marketplace.templatetags.web_format import SIMULATED_HOST_FLAGS

OFFER_PAGE = 50
ORDERINGS = [
    ("price", "price, lowest first"),
    ("price_per_tflop", "$ per TFLOP-hour, lowest first"),
    ("-tflops", "tensor TFLOPS, highest first"),
    ("-memory", "memory, largest first"),
    ("-free_gpus", "free GPUs, most first"),
    ("-reliability", "reliability, highest first"),
    ("-price", "price, highest first"),
]


@require_GET
def offers(request: HttpRequest) -> HttpResponse:
    """What is free right now, filtered like GET /api/v1/offers/ (the same validation)."""
    # A form submits its empty fields; an empty field is no constraint.
    query = {key: value for key, value in request.GET.items() if value.strip()}
    form = OfferQuerySerializer(data=query)
    context = {
        "query": query,
        "catalog": selectors.gpu_model_list(),
        "orderings": ORDERINGS,
        "ordering": query.get("ordering", "price"),
        "rows": [],
        "errors": [],
    }
    if not form.is_valid():
        context["errors"] = [
            f"{field}: {' '.join(str(m) for m in messages)}"
            for field, messages in form.errors.items()
        ]
        return render(request, "web/offers.html", context, status=400)
    data = form.validated_data
    offset = data["offset"]
    rows = selectors.offer_page(
        filters=selectors.offer_filters(data), limit=OFFER_PAGE + 1, offset=offset
    )
    context["rows"] = rows[:OFFER_PAGE]
    base = {k: v for k, v in query.items() if k != "offset"}
    if len(rows) > OFFER_PAGE:
        context["next_query"] = urlencode({**base, "offset": offset + OFFER_PAGE})
    if offset:
        context["previous_query"] = urlencode({**base, "offset": max(0, offset - OFFER_PAGE)})
    return render(request, "web/offers.html", context)


@require_GET
@login_required
@team_page
def rentals(request: HttpRequest) -> HttpResponse:
    status = request.GET.get("status") or None
    if status is not None and status not in RentalStatus.values:
        return render(
            request,
            "web/rentals.html",
            {"errors": [f"status: unknown status {status!r}"], "statuses": RentalStatus.values},
            status=400,
        )
    team = request_team(request)
    page = Paginator(selectors.rental_list(team=team, status=status), 50).get_page(
        request.GET.get("page")
    )
    return render(
        request,
        "web/rentals.html",
        {"page": page, "status": status, "statuses": RentalStatus.values, "errors": []},
    )


@require_GET
@login_required
@team_page
def rental_new(request: HttpRequest) -> HttpResponse:
    """A rental request with every constraint the API takes; prefilled from an offer's link."""
    return render(
        request,
        "web/rental_new.html",
        {
            "catalog": selectors.gpu_model_list(),
            "harness_image": settings.GPUMARKET["HARNESS_IMAGE"],
            "initial": {
                "gpu_model": request.GET.get("gpu_model", ""),
                "gpus_per_node": request.GET.get("gpus", "1"),
                "region": request.GET.get("region", ""),
                "max_price": request.GET.get("max_price", ""),
                "resume_from": request.GET.get("resume_from", ""),
            },
            # The storage app's rows, through the relation it declares (it sits above).
            "datasets": request_team(request).datasets.ready().order_by("name"),
            "templates": selectors.template_list(team=request_team(request)),
            "initial_template": request.GET.get("template", ""),
            "secrets": secret_list(team=request_team(request)),
        },
    )


@require_GET
@login_required
@team_page
def templates(request: HttpRequest) -> HttpResponse:
    """The team's rental templates: saved, listed, removed, and a rental started from one."""
    return render(
        request,
        "web/templates.html",
        {
            "templates": selectors.template_list(team=request_team(request)),
            "harness_image": settings.GPUMARKET["HARNESS_IMAGE"],
        },
    )


@require_GET
@login_required
@team_page
def rental_detail(request: HttpRequest, rental_id) -> HttpResponse:
    rental = selectors.rental_get(team=request_team(request), rental_id=rental_id)
    if rental is None:  # another team's rental is as absent as one that never existed
        raise Http404("no such rental")
    jupyter_port = selectors.JUPYTER_PORT if rental.jupyter else None
    return render(
        request,
        "web/rental_detail.html",
        {
            "rental": rental,
            "jupyter_url": next(
                (a["url"] for a in rental.access if a["container_port"] == jupyter_port), ""
            ),
            "port_urls": [
                a for a in rental.access if a["url"] and a["container_port"] != jupyter_port
            ],
            "active": rental.status in lifecycle.ACTIVE,
            "cancellable": rental.status in lifecycle.CANCELLABLE,
            "stoppable": rental.status in lifecycle.BURNING,
            "gpu_chart_kinds": [
                ("util", "Utilisation"),
                ("mem", "Memory used"),
                ("power", "Power"),
                ("temp", "Temperature"),
            ],
            "artifacts": rental.artifacts.order_by("path"),
            # What each run's agent reported, shown as reported: never what is billed.
            "reported_runs": rental.runs.order_by("id").values("started_at", "finished_at"),
            "retention_days": settings.STORAGE["ARTIFACT_RETENTION_DAYS"],
        },
    )


@require_GET
@login_required
def provider(request: HttpRequest) -> HttpResponse:
    """For provider owners: each provider's nodes (prices, cluster, drain / relist), its
    clusters, a join token for a new host, and earnings."""
    providers = [
        (
            p,
            selectors.provider_nodes(owner=request.user, provider_id=p.pk),
            selectors.provider_clusters(owner=request.user, provider_id=p.pk),
        )
        for p in selectors.provider_list(owner=request.user)
    ]
    return render(
        request,
        "web/provider.html",
        {
            "providers": providers,
            "server_url": request.build_absolute_uri("/").rstrip("/"),
            "simulated_host_flags": SIMULATED_HOST_FLAGS,
            "interconnects": Interconnect.choices,
            "cluster_gbps_max": CLUSTER_GBPS_MAX,
        },
    )
