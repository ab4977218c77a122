"""The benchmarks fill their database with COPY, below the ORM: a column the models made
required must reach those statements too, or every bench that builds an inventory fails (as
offers.py and scheduler.py did once Node.runtime was added). This builds a small one."""

from __future__ import annotations

import sys

import pytest

from marketplace.models import Allocation, Gpu, Node, Rental
from tests.e2e.conftest import ROOT, _database_url

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_bench_inventory_loads_into_the_current_schema():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from _common import build_inventory
    finally:
        sys.path.remove(str(ROOT / "bench"))
    # given the schema as the migrations leave it, when the bench fills it
    gpus = build_inventory(_database_url(), 4, busy_node_fraction=0.5)
    # then every node, GPU and busy rental is there, readable through the models
    assert Node.objects.count() == 4 and Gpu.objects.count() == 32 == gpus
    assert all(node.runtime == "docker" for node in Node.objects.all())
    assert Allocation.objects.count() == 4 * Rental.objects.count() > 0
