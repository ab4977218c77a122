"""Offers: exact rows and exact order against hand-computed expectations."""

from datetime import timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.utils import timezone

from marketplace.models import Allocation, NodeStatus, Rental
from tests.factories import personal_team

pytestmark = pytest.mark.django_db


def _hold(node, count, *, start, end, released=False):
    """Bind `count` GPUs of `node` to a throwaway rental for [start, end)."""
    rental = Rental.objects.create(
        customer=node.provider.owner,
        team=personal_team(node.provider.owner),
        gpus_per_node=count,
        start_at=start,
        start_deadline=start,
        duration_s=int((end - start).total_seconds()),
        image="img",
    )
    for gpu in node.gpus.order_by("index")[:count]:
        Allocation.objects.create(
            rental=rental,
            gpu=gpu,
            node=node,
            during=DateTimeTZRange(start, end),
            released_at=timezone.now() if released else None,
        )


@pytest.fixture
def fleet(make_node):
    now = timezone.now()
    nodes = {
        "n1": make_node(card="a100-sxm4-80gb", price="1.50", region="eu-west", nvlink=True,
                        reliability="0.99"),
        "n2": make_node(card="h100-sxm5-80gb", price="2.50", region="eu-central", nvlink=True,
                        reliability="0.98"),
        "n3": make_node(card="rtx4090-24gb", gpus=4, price="0.40", region="eu-central",
                        reliability="0.90"),
        "n4": make_node(card="v100-sxm2-16gb", price="0.30", region="us-east", nvlink=True,
                        reliability="0.97"),
        "n5": make_node(card="a100-sxm4-40gb", price="1.10", region="us-east",
                        status=NodeStatus.OFFLINE),
        "n6": make_node(card="l40s-48gb", gpus=4, price="0.90", region="us-west",
                        reliability="0.96"),
    }  # fmt: skip
    n6 = nodes["n6"]
    _hold(n6, 3, start=now - timedelta(hours=1), end=now + timedelta(hours=1))
    # Neither a future booking nor a released one holds a GPU right now.
    _hold(nodes["n1"], 8, start=now + timedelta(hours=2), end=now + timedelta(hours=3))
    _hold(nodes["n2"], 8, start=now - timedelta(hours=1), end=now + timedelta(hours=1),
          released=True)  # fmt: skip
    return {name: node.pk for name, node in nodes.items()}


def _ids(api, fleet, **params):
    r = api.get("/api/v1/offers/", params)
    assert r.status_code == 200, r.content
    by_id = {v: k for k, v in fleet.items()}
    return [by_id[row["node_id"]] for row in r.json()["results"]]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, ["n4", "n3", "n6", "n1", "n2"]),
        ({"ordering": "-price"}, ["n2", "n1", "n6", "n3", "n4"]),
        ({"min_memory_gb": 40}, ["n6", "n1", "n2"]),
        # $/TFLOP-hour: n4 .002400, n3 .002421, n6 .002486, n2 .002528, n1 .004808
        ({"ordering": "price_per_tflop"}, ["n4", "n3", "n6", "n2", "n1"]),
        ({"region": "eu"}, ["n3", "n1", "n2"]),
        ({"region": "eu-central"}, ["n3", "n2"]),
        # A region names itself and its zones; "_" is no wildcard ("e_" is not "eu")
        ({"region": "e_"}, []),
        ({"region": "eu_central"}, []),
        ({"nvlink": "true", "max_price": "2.00"}, ["n4", "n1"]),
        ({"nvlink": "false"}, ["n3", "n6"]),
        ({"min_free_gpus": 4}, ["n4", "n3", "n1", "n2"]),
        ({"gpu_family": "a100,h100", "ordering": "-memory"}, ["n1", "n2"]),
        ({"min_tensor_tflops": "300", "min_reliability": "0.98"}, ["n1", "n2"]),
        ({"gpu_model": "rtx4090-24gb"}, ["n3"]),
        ({"ordering": "-free_gpus"}, ["n4", "n1", "n2", "n3", "n6"]),
        ({"max_price": "0.10"}, []),
    ],
)
def test_offer_filters_give_exact_rows_in_exact_order(api, fleet, params, expected):
    assert _ids(api, fleet, **params) == expected


def test_offer_row_counts_free_gpus_right_now(api, fleet):
    rows = api.get("/api/v1/offers/", {"region": "us-west"}).json()["results"]
    assert len(rows) == 1
    row = rows[0]
    assert (row["free_gpus"], row["gpu_count"], row["gpu_model"], row["price_per_gpu_hour"]) == (
        1,
        4,
        "l40s-48gb",
        "0.9000",
    )
    assert row["price_per_tflop_hour"] == "0.002486"


def test_offers_paginate(api, fleet):
    first = api.get("/api/v1/offers/", {"limit": 2}).json()
    assert [r["node_id"] for r in first["results"]] == [fleet["n4"], fleet["n3"]]
    assert first["previous"] is None
    second = api.get(first["next"]).json()
    assert [r["node_id"] for r in second["results"]] == [fleet["n6"], fleet["n1"]]
    last = api.get(second["next"]).json()
    assert [r["node_id"] for r in last["results"]] == [fleet["n2"]]
    assert last["next"] is None
    assert "offset=2" in last["previous"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"min_memory_gb": "abc"}, "min_memory_gb"),
        ({"min_memory_gb": "0"}, "min_memory_gb"),
        ({"ordering": "cheapest"}, "ordering"),
        ({"nvlink": "maybe"}, "nvlink"),
        ({"max_price": "-1"}, "max_price"),
        ({"min_reliability": "2"}, "min_reliability"),
        ({"min_tensor_tflops": "lots"}, "min_tensor_tflops"),
        ({"gpu_model": ",,"}, "gpu_model"),
        ({"gpu_family": "a100;drop"}, "gpu_family"),
        ({"region": "eu west"}, "region"),
        ({"min_free_gpus": "-3"}, "min_free_gpus"),
        ({"limit": "0"}, "limit"),
        ({"offset": "x"}, "offset"),
        ({"gpu": "a100"}, "gpu"),
    ],
)
def test_bad_filter_values_answer_400_naming_the_parameter(api, fleet, params, field):
    r = api.get("/api/v1/offers/", params)
    assert r.status_code == 400
    assert list(r.json()) == [field]


def test_schema_and_docs_are_served(api):
    schema = api.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/v1/offers/" in schema.content
    assert api.get("/api/docs/").status_code == 200
