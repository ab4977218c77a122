"""Offers: exact rows and exact order against hand-computed expectations."""

import threading
import time
from datetime import timedelta

import pytest
from django.db.backends.postgresql.psycopg_any import DateTimeTZRange
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.services.tokens import api_token_create
from marketplace import selectors
from marketplace.models import Allocation, Node, NodeStatus, Rental
from marketplace.selectors import OFFER_PAGE_GRACE_S
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db


def _hold(node, count, *, start, end, released=False, first=0):
    """Bind `count` GPUs of `node` from index `first` on to a throwaway rental for [start, end)."""
    rental = Rental.objects.create(
        customer=node.provider.owner,
        team=personal_team(node.provider.owner),
        gpus_per_node=count,
        start_at=start,
        start_deadline=start,
        duration_s=int((end - start).total_seconds()),
        image="img",
    )
    for gpu in node.gpus.order_by("index")[first : first + count]:
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


# (query, the nodes it lists in order) over `fleet`.
EXACT_ROWS = [
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
]


@pytest.mark.parametrize(("params", "expected"), EXACT_ROWS)
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


# --- The offers cache (selectors.offer_page) ----------------------------------------------------


@pytest.fixture
def offers_cache(settings):
    """The offers cache on for `ttl_s` seconds (the test settings turn it off), with no entry
    left from another test's fleet (the key is the question, not the database)."""
    from core.redis_clients import redis_clients

    def turn_on(ttl_s: float = 60.0):
        settings.GPUMARKET = {**settings.GPUMARKET, "OFFERS_CACHE_TTL_S": ttl_s}
        return client

    client = redis_clients().background()
    for key in client.scan_iter("gpumarket:offers:*"):
        client.delete(key)
    yield turn_on
    for key in client.scan_iter("gpumarket:offers:*"):
        client.delete(key)


def test_cached_pages_answer_each_question_with_its_own_rows(api, fleet, offers_cache):
    # Given the cache on and every filter set of the exact-rows test asked once (each stored)
    offers_cache()
    for params, expected in EXACT_ROWS:
        assert _ids(api, fleet, **params) == expected, params
    # When each is asked again, now from the cache, in the opposite order
    # Then each filter set still gets its own rows, never another's
    for params, expected in reversed(EXACT_ROWS):
        assert _ids(api, fleet, **params) == expected, params


def _entries(client) -> list[bytes]:
    return [k for k in client.keys("gpumarket:offers:*") if not k.endswith((b":refresh", b":fill"))]


def _book_last_free_gpu(fleet) -> None:
    """n6 has 3 of its 4 GPUs held: hold the 4th, so that it is no longer offered."""
    now = timezone.now()
    n6 = Node.objects.get(pk=fleet["n6"])
    _hold(n6, 1, start=now - timedelta(hours=1), end=now + timedelta(hours=1), first=3)


def test_a_cached_page_is_served_at_most_its_ttl(api, fleet, offers_cache):
    # Given a page read with the cache on for 60 s
    client = offers_cache(60.0)
    assert _ids(api, fleet, region="us-west") == ["n6"]
    [key] = _entries(client)
    # When its last free GPU is booked
    _book_last_free_gpu(fleet)
    # Then the page still lists it from the cache, and Redis drops the entry within the TTL
    assert _ids(api, fleet, region="us-west") == ["n6"]
    assert 0 < client.pttl(key) <= 60_000
    # Once the entry is gone (expired), the statement runs again and the node is not listed
    client.delete(key)
    assert _ids(api, fleet, region="us-west") == []


def test_past_half_its_ttl_one_request_refreshes_while_the_others_read(
    api, fleet, offers_cache, monkeypatch
):
    # Given a page read with the cache on for 60 s, then its last free GPU booked
    client = offers_cache(60.0)
    assert _ids(api, fleet, region="us-west") == ["n6"]
    [key] = _entries(client)
    _book_last_free_gpu(fleet)
    # When more than half the TTL has passed while another request is refreshing the entry
    later = time.time() + 31
    monkeypatch.setattr("marketplace.selectors.time.time", lambda: later)
    client.set(key + b":refresh", 1, px=60_000)
    # Then this one reads the entry as it was
    assert _ids(api, fleet, region="us-west") == ["n6"]
    # And once no refresh is under way, the next request runs the statement and stores its
    # answer for another TTL from then
    client.delete(key + b":refresh")
    assert _ids(api, fleet, region="us-west") == []
    assert _ids(api, fleet, region="us-west") == []
    assert client.pttl(key) > 30_000


def test_with_no_entry_the_others_wait_for_the_one_running_the_statement(api, fleet, offers_cache):
    # Given a page's answer, then its entry gone and another request running the statement
    # again (its fill flag set), and the page's last free GPU booked meanwhile
    client = offers_cache(60.0)
    assert _ids(api, fleet, region="us-west") == ["n6"]
    [key] = _entries(client)
    answer = client.get(key)
    client.delete(key)
    client.set(key + b":fill", 1, px=60_000)
    _book_last_free_gpu(fleet)
    # When that request stores its answer 0.3 s later
    stored = threading.Timer(0.3, client.set, args=(key, answer), kwargs={"px": 60_000})
    stored.start()
    # Then this one waited for it and answers with it (its own statement would list nothing)
    assert _ids(api, fleet, region="us-west") == ["n6"]
    stored.join()


def test_a_request_waits_for_another_s_answer_at_most_the_ttl(api, fleet, offers_cache):
    # Given a fill flag left by a request that never answers (a process killed, say)
    client = offers_cache(0.5)
    assert _ids(api, fleet, region="us-west") == ["n6"]
    [key] = _entries(client)
    client.delete(key)
    client.set(key + b":fill", 1, px=60_000)
    _book_last_free_gpu(fleet)
    # When a request asks the same question
    # Then past the TTL it runs the statement itself, and stores the answer
    assert _ids(api, fleet, region="us-west") == []
    assert _entries(client) == [key]


def test_an_answer_that_outlasted_the_ttl_is_kept_for_those_who_waited(
    api, fleet, offers_cache, monkeypatch
):
    # Given the cache on for 5 s, and a statement that takes longer than that (the clock moves
    # 10 s while it runs)
    client = offers_cache(5.0)
    clock = [time.time()]
    statement = selectors.queries.offers_run

    def slow_statement(sql, params):
        rows = statement(sql, params)
        clock[0] += 10
        return rows

    monkeypatch.setattr(selectors.queries, "offers_run", slow_statement)
    monkeypatch.setattr("marketplace.selectors.time.time", lambda: clock[0])
    # When a page is read
    assert _ids(api, fleet, region="us-west") == ["n6"]
    # Then its answer is stored for the grace, no longer
    [key] = _entries(client)
    assert 0 < client.pttl(key) <= OFFER_PAGE_GRACE_S * 1000


def test_every_caller_gets_the_answer_of_the_statement(api, auth_api, fleet, offers_cache):
    # The offers statement reads nothing of the caller (no account, team or price per customer):
    # one answer for one question, whoever asks. Given another team's client beside `auth_api`
    other = APIClient()
    other_user = UserFactory()
    _, raw = api_token_create(user=other_user, team=personal_team(other_user), name="t")
    other.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    fresh = api.get("/api/v1/offers/", {"min_memory_gb": 40}).json()["results"]
    client = offers_cache()
    # When an anonymous client, one team and another ask the same question
    answers = [
        c.get("/api/v1/offers/", {"min_memory_gb": 40}).json()["results"]
        for c in (api, auth_api, other)
    ]
    # Then each gets exactly what the statement answers, from one entry
    assert answers == [fresh, fresh, fresh]
    assert len(_entries(client)) == 1


def test_the_web_page_reads_through_the_cache_too(client, api, fleet, offers_cache):
    # Given the cache on, and the page and the API read once
    redis = offers_cache()
    n6 = Node.objects.get(pk=fleet["n6"])
    first = client.get(reverse("web-offers"), {"region": "us-west"})
    assert first.status_code == 200
    assert n6.hostname in first.content.decode()
    assert _ids(api, fleet, region="us-west") == ["n6"]
    # When the node's last free GPU is booked
    _book_last_free_gpu(fleet)
    # Then both list it from their own entries (rows for the page, the serialized rows for the
    # API) until their TTL
    assert n6.hostname in client.get(reverse("web-offers"), {"region": "us-west"}).content.decode()
    assert _ids(api, fleet, region="us-west") == ["n6"]
    assert len(_entries(redis)) == 2


def test_a_cached_api_page_is_the_same_json(api, fleet, offers_cache):
    # Given a page as it is answered with no cache
    params = {"limit": 2, "offset": 1, "ordering": "price_per_tflop"}
    fresh = api.get("/api/v1/offers/", params).content
    # When the same page is stored, then read from the cache
    offers_cache()
    stored = api.get("/api/v1/offers/", params).content
    cached = api.get("/api/v1/offers/", params).content
    # Then all three are the same bytes (rows, field order, decimals as strings, links)
    assert stored == fresh
    assert cached == fresh


def test_bad_values_answer_400_with_the_cache_on(api, fleet, offers_cache):
    client = offers_cache()
    r = api.get("/api/v1/offers/", {"max_price": "-1"})
    assert r.status_code == 400
    assert list(r.json()) == ["max_price"]
    assert client.keys("gpumarket:offers:*") == []


def test_offers_answer_from_the_statement_while_redis_is_unreachable(api, fleet, offers_cache):
    # Given the cache on and a Redis address that refuses connections
    import socket

    from core.redis_clients import RedisClients, redis_clients_replaced

    offers_cache()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with redis_clients_replaced(RedisClients(f"redis://127.0.0.1:{port}/0")):
        # Then pages still answer, with the statement's rows
        assert _ids(api, fleet, region="eu") == ["n3", "n1", "n2"]
        assert _ids(api, fleet, region="eu") == ["n3", "n1", "n2"]


# --- Every card's cheapest offers in one statement (the advisor's question) ----------------------


def test_each_card_s_cheapest_in_one_statement_are_the_list_s_per_card(fleet, make_node):
    # Given more nodes of two cards, at prices that interleave, one of them degraded
    for price in ("1.20", "1.90", "1.40", "0.95"):
        make_node(card="a100-sxm4-80gb", price=price, pool="spot")
    for price in ("2.10", "2.70"):
        make_node(card="h100-sxm5-80gb", price=price, region="us-east", cluster=None)
    degraded = make_node(card="a100-sxm4-80gb", price="0.50")
    degraded.gpus.filter(index=0).update(health="degraded")
    for filters in (selectors.OfferFilters(), selectors.OfferFilters(region="eu")):
        # When every card's two cheapest are read in one statement
        by_card = selectors.offers_by_card(filters=filters, per_card=2, shape=list, cached=False)
        # Then they are, card by card, the list's first two rows of that card, in its order
        expected = []
        for card in sorted({row["gpu_model"] for row in selectors.offer_page(
            filters=filters, limit=100, offset=0
        )}):  # fmt: skip
            one = selectors.offer_page(
                filters=selectors.OfferFilters(gpu_models=(card,), region=filters.region),
                limit=2,
                offset=0,
            )
            expected += [(row["gpu_model"], row["node_id"], row["free_gpus"]) for row in one]
        assert [(r["gpu_model"], r["node_id"], r["free_gpus"]) for r in by_card] == expected
        # With each node's pool and uplink besides
        nodes = {n.pk: n for n in Node.objects.filter(pk__in=[r["node_id"] for r in by_card])}
        for row in by_card:
            node = nodes[row["node_id"]]
            assert (row["pool"], row["net_up_mbps"], row["net_down_mbps"]) == (
                node.pool, node.net_up_mbps, node.net_down_mbps
            )  # fmt: skip
    # And the degraded node, cheapest of its card, is ranked after its card's healthy ones
    rows = selectors.offers_by_card(
        filters=selectors.OfferFilters(gpu_models=("a100-sxm4-80gb",)),
        per_card=10,
        shape=list,
        cached=False,
    )
    assert rows[-1]["node_id"] == degraded.pk and len(rows) == 6
