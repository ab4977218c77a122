"""Thin API views: validate input, call one selector or service, shape the output."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse
from django.template.loader import render_to_string
from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.tenancy import request_team
from billing import selectors, services
from billing.api.serializers import (
    AccountSerializer,
    BudgetSerializer,
    BudgetUpdateSerializer,
    GpuSeriesAnswerSerializer,
    InvoiceDetailSerializer,
    InvoiceSerializer,
    LedgerEntrySerializer,
    NoticeSerializer,
    ProviderEarningsSerializer,
    RentalUsageSerializer,
    TelemetryMinuteSerializer,
    TelemetryQuerySerializer,
    TopUpCreatedSerializer,
    TopUpCreateSerializer,
    TopUpSerializer,
)
from core.api.pagination import PaginatedListView
from core.errors import NotFound


class _ListView(PaginatedListView):
    """A paginated list of the current team's; `money`: owners and billing members only."""

    serializer_class: type
    selector: staticmethod
    money = False

    def get(self, request: Request) -> Response:
        team = request_team(request, money=self.money)
        return self.paginated(self.selector(team=team), self.serializer_class)


class AccountView(APIView):
    """The team's balance, what is accrued but not yet posted, and what running rentals cost
    (every member sees it: it decides whether a rental can be created)."""

    @extend_schema(responses=AccountSerializer)
    def get(self, request: Request) -> Response:
        summary = selectors.account_summary(team=request_team(request))
        return Response(AccountSerializer(summary).data)


class BudgetView(APIView):
    """The team's budgets and limits: the monthly budget, the concurrent-GPU and per-minute
    limits, and where it stands against each (every member). PATCH sets them (dollars for the
    budget): owners and billing members only."""

    @extend_schema(responses=BudgetSerializer)
    def get(self, request: Request) -> Response:
        team = request_team(request)
        return Response(BudgetSerializer(selectors.budget_summary(team=team)).data)

    @extend_schema(request=BudgetUpdateSerializer, responses=BudgetSerializer)
    def patch(self, request: Request) -> Response:
        body = BudgetUpdateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        team = request_team(request, money=True)
        services.account_budgets_set(
            account_id=services.account_for_team(team=team).pk,
            actor=request.user,
            **body.validated_data,
        )
        return Response(BudgetSerializer(selectors.budget_summary(team=team)).data)


class LedgerListView(_ListView):
    """The team's ledger entries, newest first (owners and billing members)."""

    money = True

    serializer_class = LedgerEntrySerializer
    selector = staticmethod(selectors.ledger_list)

    @extend_schema(responses=LedgerEntrySerializer(many=True))
    def get(self, request: Request) -> Response:
        return super().get(request)


class NoticeListView(_ListView):
    """The team's low-balance warnings and stops, newest first (every member)."""

    serializer_class = NoticeSerializer
    selector = staticmethod(selectors.notice_list)

    @extend_schema(responses=NoticeSerializer(many=True))
    def get(self, request: Request) -> Response:
        return super().get(request)


class TopUpListCreateView(PaginatedListView):
    """The team's card top-ups; POST starts one and returns the PaymentIntent's client_secret.
    Owners and billing members only (403 for other members)."""

    @extend_schema(responses=TopUpSerializer(many=True))
    def get(self, request: Request) -> Response:
        team = request_team(request, money=True)
        return self.paginated(selectors.topup_list(team=team), TopUpSerializer)

    @extend_schema(request=TopUpCreateSerializer, responses={201: TopUpCreatedSerializer})
    def post(self, request: Request) -> Response:
        body = TopUpCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        started = services.topup_create(
            team=request_team(request, money=True),
            user=request.user,
            amount_cents=body.validated_data["amount_cents"],
        )
        topup = started.topup
        topup.client_secret = started.client_secret
        topup.publishable_key = settings.STRIPE_PUBLISHABLE_KEY
        return Response(TopUpCreatedSerializer(topup).data, status=status.HTTP_201_CREATED)


class InvoiceListView(_ListView):
    """The team's monthly statements, newest first (owners and billing members)."""

    money = True

    serializer_class = InvoiceSerializer
    selector = staticmethod(selectors.invoice_list)

    @extend_schema(responses=InvoiceSerializer(many=True))
    def get(self, request: Request) -> Response:
        return super().get(request)


class InvoiceDetailView(APIView):
    """One of the team's statements with a line per rental; another team's id answers 404
    (owners and billing members)."""

    @extend_schema(responses=InvoiceDetailSerializer)
    def get(self, request: Request, invoice_id: int) -> Response:
        team = request_team(request, money=True)
        invoice = selectors.invoice_get(team=team, invoice_id=invoice_id)
        if invoice is None:
            raise NotFound("no such invoice")
        return Response(InvoiceDetailSerializer(invoice).data)


class InvoicePrintView(APIView):
    """The statement as a printable HTML page."""

    @extend_schema(responses={(200, "text/html"): OpenApiTypes.STR})
    def get(self, request: Request, invoice_id: int) -> HttpResponse:
        team = request_team(request, money=True)
        invoice = selectors.invoice_get(team=team, invoice_id=invoice_id)
        if invoice is None:
            raise NotFound("no such invoice")
        html = render_to_string(
            "billing/invoice.html",
            {"invoice": invoice, "team": invoice.account.team, "lines": invoice.lines.all()},
        )
        return HttpResponse(html, content_type="text/html; charset=utf-8")


class RentalTelemetryView(PaginatedListView):
    """Per-minute GPU telemetry of one of the team's rentals (utilisation, memory, power, heat)."""

    @extend_schema(
        parameters=[TelemetryQuerySerializer], responses=TelemetryMinuteSerializer(many=True)
    )
    def get(self, request: Request, rental_id) -> Response:
        rental = selectors.team_rental(team=request_team(request), rental_id=rental_id)
        if rental is None:
            raise NotFound("no such rental")
        query = TelemetryQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        rows = selectors.rental_telemetry(rental=rental, **query.validated_data)
        return self.paginated(rows, TelemetryMinuteSerializer)


class RentalGpuSeriesView(APIView):
    """Per-GPU utilisation, memory, power and temperature of one of the team's rentals over
    time, for charts: raw samples for a window of up to 2 hours (the last hour by default),
    minute rollups for a longer one; at most 600 points per GPU."""

    @extend_schema(parameters=[TelemetryQuerySerializer], responses=GpuSeriesAnswerSerializer)
    def get(self, request: Request, rental_id) -> Response:
        rental = selectors.team_rental(team=request_team(request), rental_id=rental_id)
        if rental is None:
            raise NotFound("no such rental")
        query = TelemetryQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        series = selectors.rental_gpu_series(
            rental=rental, since=query.validated_data["since"], until=query.validated_data["until"]
        )
        return Response(GpuSeriesAnswerSerializer(series).data)


class RentalUsageView(APIView):
    """What one of the team's rentals is billed for: its confirmed runs and rated seconds."""

    @extend_schema(responses=RentalUsageSerializer)
    def get(self, request: Request, rental_id) -> Response:
        rental = selectors.team_rental(team=request_team(request), rental_id=rental_id)
        if rental is None:
            raise NotFound("no such rental")
        cap, bound = selectors.rental_cap(rental=rental)
        usage = {
            "rental": rental,
            "meters": selectors.rental_meters(rental=rental),
            "segments": selectors.rental_segments(rental=rental),
            "max_charge_micros": cap,
            "cap_overrun_bound_micros": bound,
        }
        return Response(RentalUsageSerializer(usage).data)


class EarningsView(APIView):
    """For provider owners: each provider's earnings (its share after the platform fee), what is
    still to be paid out, the latest ledger entries and payouts."""

    @extend_schema(responses=ProviderEarningsSerializer(many=True))
    def get(self, request: Request) -> Response:
        return Response(
            ProviderEarningsSerializer(
                selectors.provider_earnings(owner=request.user), many=True
            ).data
        )
