"""Images on real PostgreSQL: what agents reported (their allow-lists and the images they hold,
applied by the heartbeat service) reaches the engine through the scheduler's own queries, and a
rental whose image no node accepts is refused at create, naming `image`."""

import pytest

from core.errors import ValidationFailed
from marketplace.models import Allocation, Rental
from marketplace.services.rentals import RuntimeSpec
from provisioning.services import HeartbeatReports, node_heartbeat
from scheduler.services import scheduler_cycle_run

pytestmark = pytest.mark.django_db

CUSTOM = "ghcr.io/team/train:1"


def _hosts(rental) -> set[str]:
    return set(
        Allocation.objects.filter(rental=rental, released_at__isnull=True).values_list(
            "node__hostname", flat=True
        )
    )


def _reported(node, **reports) -> None:
    node_heartbeat(node=node, reports=HeartbeatReports(**reports))


def test_a_rental_is_placed_only_where_the_agent_accepts_its_image(make_node, rent):
    # given a cheap node whose agent takes the harness image only, and a dearer one taking any
    cheap = make_node(hostname="cheap", price="1.00")
    make_node(hostname="dear", price="2.00")
    _reported(cheap, image_allow=("gpumarket/harness:*",))
    # when a rental of another image is scheduled
    rental = rent(8, runtime=RuntimeSpec(image=CUSTOM))
    scheduler_cycle_run()
    # then it lands on the dearer node, and a harness rental still takes the cheap one
    assert _hosts(rental) == {"dear"}
    harness = rent(8)
    scheduler_cycle_run()
    assert _hosts(harness) == {"cheap"}


def test_among_equal_nodes_the_one_holding_the_image_is_chosen(make_node, rent):
    make_node(hostname="cold")
    warm = make_node(hostname="warm")
    _reported(warm, images=[])  # reported, then its cache changes: the latest report counts
    from agentprotocol import CachedImage

    _reported(warm, images=[CachedImage(ref=CUSTOM, digest="sha256:aa", size_bytes=1)])
    rental = rent(2, runtime=RuntimeSpec(image=CUSTOM))
    scheduler_cycle_run()
    assert _hosts(rental) == {"warm"}
    # an image named without its tag is the same image as `:latest`
    _reported(warm, images=[CachedImage(ref="ghcr.io/team/train:latest")])
    untagged = rent(2, runtime=RuntimeSpec(image="ghcr.io/team/train"))
    scheduler_cycle_run()
    assert _hosts(untagged) == {"warm"}


def test_an_image_no_node_accepts_is_refused_at_create_naming_image(make_node, rent):
    node = make_node(hostname="only")
    _reported(node, image_allow=("gpumarket/harness:*",))
    before = Rental.objects.count()
    with pytest.raises(ValidationFailed) as refused:
        rent(1, runtime=RuntimeSpec(image=CUSTOM))
    assert refused.value.field == "image"
    assert f"no matching node accepts the image {CUSTOM!r}" in str(refused.value)
    assert Rental.objects.count() == before


def test_the_refusal_reaches_the_api_as_a_400_naming_image(make_node, auth_api):
    node = make_node(hostname="only")
    _reported(node, image_allow=())
    r = auth_api.post(
        "/api/v1/rentals/",
        {"gpus_per_node": 1, "duration_s": 3600, "runtime": {"image": CUSTOM}},
        format="json",
    )
    assert r.status_code == 400
    assert r.json()["image"] == [
        f"this request can never be placed: image: no matching node accepts the image {CUSTOM!r}"
    ]
