"""A rental's network: the filtered internet by default, internal on request. A rental with
the internet is refused at create when none of the listed nodes that meet the rest of the
request can filter it, and never placed on one that cannot; an internal one runs anywhere."""

import pytest

from billing.models import FundsHold
from marketplace.models import Allocation, Node, Rental, RentalEvent, RentalStatus
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db

BODY = {
    "gpus_per_node": 2,
    "gpu_families": ["a100"],
    "duration_s": 3600,
    "runtime": {"image": "img"},
}


def _unfiltered(node):
    """The node's engine runs without iptables: its agent cannot filter a rental's internet."""
    Node.objects.filter(pk=node.pk).update(internet_filtered=False, internet_capable=False)
    return node


def test_a_rental_has_the_internet_by_default_and_says_so(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    r = auth_api.post("/api/v1/rentals/", BODY, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["network"] == "internet"
    assert Rental.objects.get().network == "internet"
    internal = auth_api.post("/api/v1/rentals/", {**BODY, "network": "internal"}, format="json")
    assert internal.json()["network"] == "internal"
    detail = auth_api.get(f"/api/v1/rentals/{internal.json()['id']}/").json()
    assert detail["network"] == "internal"


@pytest.mark.parametrize("bad", ["egress", "", None, 1, ["internet"]])
def test_a_bad_network_is_a_400_naming_it_and_writes_nothing(auth_api, make_node, bad):
    make_node(card="a100-sxm4-80gb")
    r = auth_api.post("/api/v1/rentals/", {**BODY, "network": bad}, format="json")
    assert r.status_code == 400, r.content
    assert list(r.json()) == ["network"]
    assert (Rental.objects.count(), RentalEvent.objects.count()) == (0, 0)


def test_internet_no_matching_node_can_filter_is_400_naming_network_and_writes_nothing(
    auth_api, make_node, settings
):
    # Given the only A100 node cannot filter (an H100 node elsewhere can)
    settings.BILLING_FUNDS_CHECK = True
    _unfiltered(make_node(card="a100-sxm4-80gb", price="1.00"))
    make_node(card="h100-sxm5-80gb", price="3.00")

    # When a rental of A100s with the internet (the default) is asked for
    r = auth_api.post("/api/v1/rentals/", BODY, format="json")

    # Then it is refused with the field named, and nothing is stored or held
    assert r.status_code == 400, r.content
    assert r.json()["network"] == [
        "this request can never be placed: network: only 0 matching nodes can keep a rental's "
        "internet to public addresses, the request needs 1; network internal runs anywhere"
    ]
    assert (Rental.objects.count(), RentalEvent.objects.count(), FundsHold.objects.count()) == (
        0,
        0,
        0,
    )
    # The same request with an internal network fits that node (stored, but for the funds)
    internal = auth_api.post("/api/v1/rentals/", {**BODY, "network": "internal"}, format="json")
    assert internal.status_code == 402, internal.content


def test_placement_skips_the_unfiltered_node_for_a_rental_with_internet(make_node, rent):
    # Given a cheaper node that cannot filter and a dearer one that can
    _unfiltered(make_node(card="a100-sxm4-80gb", price="1.00", hostname="open-1"))
    make_node(card="a100-sxm4-80gb", price="1.80", hostname="filtered-1")

    # When a rental with the internet is placed
    rental = rent(2)
    scheduler_cycle_run()

    # Then it is on the filtering node at its price; an internal one takes the cheaper node
    rental.refresh_from_db()
    assert rental.status == RentalStatus.SCHEDULED
    held = Allocation.objects.filter(rental=rental).values_list("node__hostname", flat=True)
    assert (set(held), str(rental.price_per_gpu_hour)) == ({"filtered-1"}, "1.8000")
    other = rent(8, network="internal")
    scheduler_cycle_run()
    held = Allocation.objects.filter(rental=other).values_list("node__hostname", flat=True)
    assert set(held) == {"open-1"}


def test_a_template_carries_the_network(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    saved = auth_api.post(
        "/api/v1/templates/", {"name": "offline", "image": "img", "network": "internal"},
        format="json",
    )  # fmt: skip
    assert saved.status_code == 201, saved.content
    assert saved.json()["network"] == "internal"
    body = {k: v for k, v in BODY.items() if k != "runtime"}
    r = auth_api.post("/api/v1/rentals/", {**body, "template": "offline"}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["network"] == "internal"
    # a body naming the network wins over its template
    r = auth_api.post(
        "/api/v1/rentals/", {**body, "template": "offline", "network": "internet"}, format="json"
    )
    assert r.json()["network"] == "internet"


def test_offers_say_where_a_rental_may_have_the_internet(api, make_node):
    _unfiltered(make_node(card="a100-sxm4-80gb", hostname="open-1"))
    make_node(card="a100-sxm4-80gb", hostname="filtered-1")
    offers = api.get("/api/v1/offers/").json()["results"]
    assert {o["hostname"]: o["internet"] for o in offers} == {
        "open-1": False,
        "filtered-1": True,
    }
