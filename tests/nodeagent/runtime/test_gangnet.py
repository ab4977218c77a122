"""The gang network's derivations: what every member's host computes alike from the run's
rendezvous variables, without talking to the others."""

from __future__ import annotations

import ipaddress

import pytest

from nodeagent.runtime.base import PermanentRuntimeError
from nodeagent.runtime.gangnet import OVERLAY_SPACE, Gang, vxlan_name

RENTAL = "0b5f4c1e-6a7d-4e0f-9c2b-3d1a8e7f6a55"


def _env(rank: int, addrs: tuple[str, ...] = ("10.0.0.1", "10.0.0.2")) -> dict[str, str]:
    return {
        "NNODES": str(len(addrs)), "NODE_RANK": str(rank), "MASTER_ADDR": addrs[0],
        "GPUMARKET_NODE_ADDR": addrs[rank], "GPUMARKET_GANG_ADDRS": ",".join(addrs),
    }  # fmt: skip


def test_a_single_node_run_has_no_gang():
    assert Gang.of(RENTAL, {"NNODES": "1", "NODE_RANK": "0"}) is None
    assert Gang.of(RENTAL, {}) is None


def test_every_member_derives_the_same_network_and_its_own_address():
    first, second = Gang.of(RENTAL, _env(0)), Gang.of(RENTAL, _env(1))
    assert (first.vni, first.subnet) == (second.vni, second.subnet)
    assert 1 <= first.vni < 2**24
    assert first.subnet.subnet_of(OVERLAY_SPACE) and first.subnet.prefixlen == 24
    base = first.subnet.network_address
    assert first.overlay_env() == {
        "MASTER_ADDR": str(base + 2),
        "GPUMARKET_NODE_ADDR": str(base + 2),
        "GPUMARKET_GANG_ADDRS": f"{base + 2},{base + 3}",
    }
    assert second.overlay_env()["GPUMARKET_NODE_ADDR"] == str(base + 3)
    assert second.overlay_env()["MASTER_ADDR"] == str(base + 2)
    # the engine's gateway address is no member's
    assert first.gateway == str(base + 1)


def test_two_rentals_get_different_networks():
    other = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
    a, b = Gang.of(RENTAL, _env(0)), Gang.of(other, _env(0))
    assert a.vni != b.vni
    assert not ipaddress.ip_network(a.subnet).overlaps(b.subnet)


@pytest.mark.parametrize(
    "env",
    [
        {**_env(0), "GPUMARKET_GANG_ADDRS": "10.0.0.1"},  # fewer addresses than nodes
        {**_env(0), "NODE_RANK": "2"},  # rank out of range
        {**_env(0), "NODE_RANK": "x"},
    ],
)
def test_an_inconsistent_gang_description_is_refused(env):
    with pytest.raises(PermanentRuntimeError):
        Gang.of(RENTAL, env)


def test_the_tunnel_is_named_after_the_rental_bridge():
    assert vxlan_name("gpm-0123456789a") == "gpv-0123456789a"
    assert len(vxlan_name("gpm-0123456789a")) <= 15
