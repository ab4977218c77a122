"""A rental with SSH and the nodes that can give it: refused at create when none of the listed
nodes that meet the rest of the request can, and never placed on one that cannot."""

import base64
import struct

import pytest

from accounts.services.sshkeys import ssh_key_add
from billing.models import FundsHold
from marketplace.models import Allocation, Node, Rental, RentalEvent, RentalStatus
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team

pytestmark = pytest.mark.django_db

BODY = {
    "gpus_per_node": 2,
    "gpu_families": ["a100"],
    "duration_s": 3600,
    "ssh": True,
    "runtime": {"image": "img"},
}


def _blob(*parts: bytes) -> str:
    return base64.b64encode(b"".join(struct.pack(">I", len(p)) + p for p in parts)).decode()


@pytest.fixture
def ssh_key(user):
    key = f"ssh-ed25519 {_blob(b'ssh-ed25519', b'k' * 32)} me@laptop"
    return ssh_key_add(team=personal_team(user), owner=user, public_key=key)


def _without_ssh(node):
    """The node's agent runs rentals as local processes: no sshd, no published port."""
    Node.objects.filter(pk=node.pk).update(runtime="process", ssh_capable=False)
    return node


def test_ssh_no_matching_node_can_give_is_400_naming_ssh_and_writes_nothing(
    auth_api, ssh_key, make_node, settings
):
    # Given the only A100 node cannot give SSH (an H100 node elsewhere can)
    settings.BILLING_FUNDS_CHECK = True
    _without_ssh(make_node(card="a100-sxm4-80gb", price="1.00"))
    make_node(card="h100-sxm5-80gb", price="3.00")

    # When a rental of A100s with SSH is asked for
    r = auth_api.post("/api/v1/rentals/", BODY, format="json")

    # Then it is refused with the field named, and nothing is stored or held
    assert r.status_code == 400, r.content
    assert r.json()["ssh"] == [
        "this request can never be placed: ssh: no matching node can run an sshd with a"
        " published port"
    ]
    assert (Rental.objects.count(), RentalEvent.objects.count(), FundsHold.objects.count()) == (
        0,
        0,
        0,
    )
    # The same request without SSH fits that node (it would be stored)
    assert auth_api.post("/api/v1/rentals/", {**BODY, "ssh": False}, format="json").status_code in (
        201,
        402,
    )


def test_another_constraint_no_node_meets_is_named_before_ssh(auth_api, ssh_key, make_node):
    _without_ssh(make_node(card="a100-sxm4-80gb", price="1.00"))
    r = auth_api.post("/api/v1/rentals/", {**BODY, "gpus_per_node": 16}, format="json")
    assert r.status_code == 400 and "ssh" not in r.json()
    assert "16 matching GPUs" in r.json()["non_field"][0]
    assert Rental.objects.count() == 0


def test_ssh_is_accepted_when_one_matching_node_can_give_it(auth_api, ssh_key, make_node):
    _without_ssh(make_node(card="a100-sxm4-80gb", price="1.00"))
    make_node(card="a100-sxm4-80gb", price="1.80")
    r = auth_api.post("/api/v1/rentals/", BODY, format="json")
    assert r.status_code == 201, r.content
    assert Rental.objects.get().ssh is True


def test_a_gang_with_ssh_needs_as_many_capable_nodes_as_members(auth_api, ssh_key, make_node):
    _without_ssh(make_node(card="a100-sxm4-80gb", price="1.00"))
    make_node(card="a100-sxm4-80gb", price="1.80")
    r = auth_api.post("/api/v1/rentals/", {**BODY, "node_count": 2}, format="json")
    assert r.status_code == 400, r.content
    assert "only 1 matching nodes can run an sshd" in r.json()["ssh"][0]
    assert Rental.objects.count() == 0


def test_placement_skips_the_incapable_node_for_a_rental_with_ssh(ssh_key, make_node, rent):
    # Given a cheaper node that cannot give SSH and a dearer one that can
    _without_ssh(make_node(card="a100-sxm4-80gb", price="1.00", hostname="proc-1"))
    make_node(card="a100-sxm4-80gb", price="1.80", hostname="dock-1")

    # When a rental with SSH is placed
    rental = rent(2, ssh=True)
    scheduler_cycle_run()

    # Then it is on the capable node at its price (without SSH, price would pick proc-1)
    rental.refresh_from_db()
    assert rental.status == RentalStatus.SCHEDULED
    held = Allocation.objects.filter(rental=rental).values_list("node__hostname", flat=True)
    assert (set(held), str(rental.price_per_gpu_hour)) == ({"dock-1"}, "1.8000")
    other = rent(8)
    scheduler_cycle_run()
    held = Allocation.objects.filter(rental=other).values_list("node__hostname", flat=True)
    assert set(held) == {"proc-1"}


def test_a_node_that_loses_ssh_is_no_longer_chosen_for_ssh(ssh_key, make_node, rent):
    # The scheduler keeps the pool's nodes between cycles: a changed capability is read again.
    first = make_node(card="a100-sxm4-80gb", price="1.00", hostname="was-docker")
    make_node(card="a100-sxm4-80gb", price="1.80", hostname="docker")
    rent(1)  # on the cheaper node: best fit would put the next rental beside it
    scheduler_cycle_run()
    _without_ssh(first)
    rental = rent(2, ssh=True)
    scheduler_cycle_run()
    held = Allocation.objects.filter(rental=rental).values_list("node__hostname", flat=True)
    assert set(held) == {"docker"}
