"""The advisor's API: memory, estimates against published runs, plans from live offers, one-step
booking, the offers' fits= filter and bad input."""

from decimal import Decimal

import pytest

from marketplace.models import Node, Rental, RentalStatus

pytestmark = pytest.mark.django_db

# 35 B parameters, 48 layers of width 8192: 560 GB of states (16 bytes per parameter); with ZeRO-3
# and full recomputation 36.6 GB per GPU on 16 GPUs, 34.5 GB on 17: more than the 36 GB usable on
# a 40 GB card, then less. So it needs 17 GPUs.
NEEDS_17 = {
    "params_b": 35,
    "layers": 48,
    "hidden": 8192,
    "heads": 64,
    "seq_len": 1024,
    "global_batch": 256,
    "tokens_b": 10,
}


@pytest.fixture
def eight_nodes(make_node):
    return [make_node(card="a100-sxm4-40gb", price="1.00") for _ in range(8)]


# Touvron et al. 2023 (Llama 2), Table 2: pretraining on 2 T tokens on A100-80GB took 184,320,
# 368,640 and 1,720,320 GPU-hours for 7B, 13B and 70B. Section 2.2.1 compares its two clusters at
# up to 2,000 GPUs: checked at 2,048.
@pytest.mark.parametrize(
    ("model", "gpu_hours"),
    [("llama2-7b", 184_320), ("llama2-13b", 368_640), ("llama2-70b", 1_720_320)],
)
def test_estimate_reproduces_llama2_pretraining_gpu_hours(api, model, gpu_hours):
    body = {"model": model, "tokens_b": 2000, "card": "a100-sxm4-80gb", "gpus": 2048}
    r = api.post("/api/v1/advisor/estimate/", body, format="json")
    assert r.status_code == 200, r.content
    answer = r.json()
    assert answer["fits"] is True
    assert 0.8 <= answer["gpu_hours"] / gpu_hours <= 1.25
    assert answer["gpus"] == 2048 and answer["per_gpu_gb"]["total"] <= 72


# Rajbhandari et al. 2020 (ZeRO), Figure 1: 7.5 B parameters on 64 GPUs, mixed-precision Adam.
@pytest.mark.parametrize(("stage", "gb"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_memory_endpoint_gives_the_zero_paper_model_states(api, stage, gb):
    body = {"params_b": 7.5, "dp": 64, "zero_stage": stage, "precision": "fp16", "seq_len": 1}
    r = api.post("/api/v1/advisor/memory/", body, format="json")
    assert r.status_code == 200, r.content
    per_gpu = r.json()["per_gpu_gb"]
    assert per_gpu["params"] + per_gpu["grads"] + per_gpu["optimizer"] == pytest.approx(gb, abs=0.1)


def test_gpt2_xl_fits_a_32gb_v100_only_with_checkpointing(api):
    # fp16 on a V100 runs with plain data parallelism in the harness (no ZeRO): micro-batch 4.
    body = {
        "model": "gpt2-1.5b",
        "micro_batch": 4,
        "global_batch": 256,
        "tokens_b": 1,
        "card": "v100-sxm2-32gb",
        "gpus": 8,
    }
    without = api.post(
        "/api/v1/advisor/estimate/", {**body, "checkpointing": "none"}, format="json"
    )
    with_it = api.post(
        "/api/v1/advisor/estimate/", {**body, "checkpointing": "full"}, format="json"
    )
    assert without.json()["fits"] is False
    assert with_it.json()["fits"] is True and with_it.json()["precision"] == "fp16"


def test_a_model_needing_17_gpus_gets_a_gang_on_8_nodes_of_8(api, eight_nodes):
    r = api.post("/api/v1/advisor/", NEEDS_17, format="json")
    assert r.status_code == 200, r.content
    plans = r.json()["plans"]
    assert plans and min(p["gpus"] for p in plans) == 24
    fewest = next(p for p in plans if p["gpus"] == 24)
    assert (fewest["nodes"], fewest["gpus_per_node"], fewest["id"]) == (3, 8, "a100-sxm4-40gb:3x8")
    assert fewest["per_gpu_gb"]["total"] <= 36
    # Larger gangs too, by doubling up to all 64 free GPUs.
    assert [p["gpus"] for p in sorted(plans, key=lambda p: p["gpus"])] == [24, 48, 64]
    # Cost is GPUs x hours x the locked price ($1), rounded up to the cent.
    assert float(fewest["cost"]) == pytest.approx(24 * fewest["hours"], abs=0.01)
    assert sum("cheapest" in p["flags"] for p in plans) == 1


def test_a_deadline_adds_gpus(api, eight_nodes):
    base = api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    fewest = min(base, key=lambda p: p["gpus"])
    deadline = fewest["hours"] * 0.6
    r = api.post("/api/v1/advisor/", {**NEEDS_17, "deadline_hours": deadline}, format="json")
    plans = r.json()["plans"]
    assert plans and all(p["hours"] <= deadline for p in plans)
    assert min(p["gpus"] for p in plans) > fewest["gpus"]


def test_a_deadline_no_plan_meets_is_an_explained_empty_answer(api, eight_nodes):
    r = api.post("/api/v1/advisor/", {**NEEDS_17, "deadline_hours": 0.01}, format="json")
    assert r.status_code == 200
    assert r.json()["plans"] == [] and "no plan meets" in r.json()["reasons"][0]


def test_interruptible_plans_pay_the_preemption_overhead(api, eight_nodes):
    on_demand = api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    spot = api.post("/api/v1/advisor/", {**NEEDS_17, "interruptible": True}, format="json")
    spot = spot.json()["plans"]
    same = next(p for p in spot if p["id"] == on_demand[0]["id"])
    assert same["hours"] > on_demand[0]["hours"]
    assert same["checkpoint_interval_s"] > 0 and same["price_per_gpu_hour"] == "0.5000"


def test_a_model_too_big_for_any_offer_is_an_explained_empty_answer(api, make_node):
    make_node(card="rtx4090-24gb", gpus=4, price="0.40")
    r = api.post("/api/v1/advisor/", {"model": "llama2-70b", "tokens_b": 1}, format="json")
    assert r.status_code == 200
    assert r.json()["plans"] == []
    assert "does not fit the 4 GPUs free" in r.json()["reasons"][0]


def test_a_cost_too_large_to_represent_is_left_out_with_the_reason(api, make_node):
    make_node(card="t4-16gb", gpus=8, price="999999")
    body = {"model": "gpt2-124m", "tokens_b": 1_000_000}
    r = api.post("/api/v1/advisor/", body, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["plans"] == [] and "cost more than" in " ".join(r.json()["reasons"])


def test_a_plan_is_booked_in_one_step_with_its_estimate(auth_api, eight_nodes):
    plans = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    plan = next(p for p in plans if p["gpus"] == 24)
    r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": plan["id"]}, format="json")
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    assert (rental.gpu_models, rental.gpus_per_node, rental.node_count) == (
        ["a100-sxm4-40gb"],
        8,
        3,
    )
    assert rental.max_price_per_gpu_hour == Decimal("1.0000")
    assert rental.status == RentalStatus.PENDING
    assert rental.advisor_estimate["plan"] == "a100-sxm4-40gb:3x8"
    assert rental.advisor_estimate["hours"] == pytest.approx(plan["hours"])
    # Booked time: the estimate plus a fifth, in whole minutes.
    assert rental.duration_s == min(30 * 86400, -(-plan["hours"] * 3600 * 1.2 // 60) * 60)


def test_a_plan_has_the_internet_where_its_nodes_filter_it_else_no_network(auth_api, eight_nodes):
    plans = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    plan = next(p for p in plans if p["gpus"] == 24)
    r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": plan["id"]}, format="json")
    assert r.status_code == 201 and r.json()["network"] == "internet"
    # the same plan once the nodes' engines cannot filter: still bookable, with no network
    Node.objects.update(internet_filtered=False, internet_capable=False)
    r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": plan["id"]}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["network"] == "internal"


def test_booking_a_gang_no_longer_free_is_409_and_stores_nothing(auth_api, eight_nodes):
    body = {**NEEDS_17, "plan": "a100-sxm4-40gb:9x8"}
    r = auth_api.post("/api/v1/advisor/book/", body, format="json")
    assert r.status_code == 409 and "plan" in r.json()
    assert Rental.objects.count() == 0


def test_booking_needs_an_account(api, eight_nodes):
    r = api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": "a100-sxm4-40gb:3x8"}, format="json")
    assert r.status_code == 401
    assert Rental.objects.count() == 0


def test_offers_fits_keeps_nodes_that_can_hold_the_model(api, make_node):
    big = make_node(card="h100-sxm5-80gb", gpus=8, nvlink=True)
    small = make_node(card="rtx4090-24gb", gpus=2)
    both = api.get("/api/v1/offers/", {"fits": "gpt2-124m"}).json()["results"]
    assert {o["node_id"] for o in both} == {big.pk, small.pk}
    only_big = api.get("/api/v1/offers/", {"fits": "llama2-13b"}).json()["results"]
    assert [o["node_id"] for o in only_big] == [big.pk]
    assert api.get("/api/v1/offers/", {"fits": "2000b"}).json()["results"] == []
    bad = api.get("/api/v1/offers/", {"fits": "gpt-5"})
    assert bad.status_code == 400 and "fits" in bad.json()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("", {"tokens_b": 1}, "model"),
        ("", {"model": "llama2-7b", "params_b": 7, "tokens_b": 1}, "model"),
        ("", {"model": "gpt-5", "tokens_b": 1}, "model"),
        ("", {"model": "llama2-7b"}, "tokens_b"),
        ("", {"model": "llama2-7b", "tokens_b": -1}, "tokens_b"),
        ("", {"model": "llama2-7b", "tokens_b": 0}, "tokens_b"),
        ("", {"model": "llama2-7b", "tokens_b": "NaN"}, "tokens_b"),
        ("", {"model": "llama2-7b", "tokens_b": "Infinity"}, "tokens_b"),
        ("", {"model": "llama2-7b", "tokens_b": 1e300}, "tokens_b"),
        ("", {"model": "llama2-7b", "tokens_b": 1, "precision": "int4"}, "precision"),
        ("", {"model": "llama2-7b", "tokens_b": 1, "optimizer": "lion"}, "optimizer"),
        ("", {"model": "llama2-7b", "tokens_b": 1, "deadline_hours": 0}, "deadline_hours"),
        ("", {"model": "llama2-7b", "tokens_b": 1, "budget": "-5"}, "budget"),
        ("", {"model": "llama2-7b", "tokens_b": 1, "budget": "1e20"}, "budget"),
        ("", {"model": "llama2-7b", "tokens_b": 1, "gpus": 8}, "gpus"),
        ("", {"params_b": -7, "tokens_b": 1}, "params_b"),
        ("", {"params_b": 7, "hidden": 4096, "heads": 3, "tokens_b": 1}, "heads"),
        ("memory/", {"model": "llama2-7b", "dp": 0}, "dp"),
        ("memory/", {"model": "llama2-7b", "tp": 3}, "tp"),
        ("memory/", {"model": "llama2-7b", "pp": 7}, "pp"),
        ("memory/", {"model": "llama2-7b", "zero_stage": 4}, "zero_stage"),
        ("memory/", {"model": "llama2-7b", "micro_batch": -1}, "micro_batch"),
        ("memory/", {"model": "llama2-7b", "seq_len": "NaN"}, "seq_len"),
        ("memory/", {"model": "llama2-7b", "checkpointing": "some"}, "checkpointing"),
        ("estimate/", {"model": "llama2-7b", "tokens_b": 1, "card": "tpu-v5", "gpus": 8}, "card"),
        ("estimate/", {"model": "llama2-7b", "tokens_b": 1, "card": "t4-16gb", "gpus": 0}, "gpus"),
        (
            "estimate/",
            {"model": "llama2-7b", "tokens_b": 1, "card": "t4-16gb", "gpus": 8, "dp": 3},
            "dp",
        ),
        (
            "estimate/",
            {"model": "gpt2-124m", "tokens_b": 1, "card": "t4-16gb", "gpus": 4096},
            "gpus",
        ),
        ("book/", {"model": "llama2-7b", "tokens_b": 1}, "plan"),
        ("book/", {"model": "llama2-7b", "tokens_b": 1, "plan": "../x"}, "plan"),
    ],
)
def test_bad_advisor_input_is_400_naming_the_field(auth_api, eight_nodes, path, body, field):
    r = auth_api.post(f"/api/v1/advisor/{path}", body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()
    assert Rental.objects.count() == 0


def test_the_advisor_reports_its_accuracy_before_any_run(api):
    r = api.get("/api/v1/advisor/accuracy/")
    assert r.json() == {"runs": 0, "median": None, "p90": None}


@pytest.mark.parametrize(
    ("body", "card", "price"),
    [
        # A short run: its estimate is minutes, the booking the 10 minutes a booking takes at least
        ({"model": "gpt2-124m", "tokens_b": 0.01}, "rtx4090-24gb", "0.40"),
        # A long gang: the estimate plus a fifth, in whole minutes
        (NEEDS_17, "a100-sxm4-40gb", "1.00"),
    ],
)
def test_a_booked_plan_holds_exactly_what_the_plan_said_for_as_long(
    auth_api, user, make_node, settings, body, card, price
):
    from billing.models import FundsHold
    from billing.services.ledger import account_adjust, account_for_team
    from tests.factories import personal_team

    # Given offers of one card and an account that can pay
    settings.BILLING_FUNDS_CHECK = True
    for _ in range(3):
        make_node(card=card, price=price)
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=10**12,
        reason="test credit",
        actor=None,
    )
    plans = auth_api.post("/api/v1/advisor/", body, format="json").json()["plans"]
    plan = next(p for p in plans if p["card"] == card)
    assert plan["booked_s"] >= 600 and plan["booked_hours"] == plan["booked_s"] / 3600
    assert Decimal(plan["hold_usd"]) * 10**6 == plan["hold_micros"]
    assert any(f"holds ${Decimal(plan['hold_usd']):.2f}" in note for note in plan["notes"])

    # When it is booked
    r = auth_api.post("/api/v1/advisor/book/", {**body, "plan": plan["id"]}, format="json")
    assert r.status_code == 201, r.content

    # Then the rental books the duration and holds the amount the plan reported, exactly
    rental = Rental.objects.get(pk=r.json()["id"])
    hold = FundsHold.objects.get(rental=rental)
    assert rental.duration_s == plan["booked_s"]
    assert hold.amount_micros == plan["hold_micros"]
    assert hold.price_per_gpu_hour == Decimal(plan["price_per_gpu_hour"])
    assert rental.advisor_estimate["booked_s"] == plan["booked_s"]
    assert rental.advisor_estimate["hold_micros"] == plan["hold_micros"]


@pytest.fixture
def offers_cache(settings):
    """The offers cache on for 60 s (the test settings turn it off), no entry left over."""
    from core.redis_clients import redis_clients

    client = redis_clients().background()
    for key in client.scan_iter("gpumarket:offers:*"):
        client.delete(key)
    settings.GPUMARKET = {**settings.GPUMARKET, "OFFERS_CACHE_TTL_S": 60}
    yield client
    for key in client.scan_iter("gpumarket:offers:*"):
        client.delete(key)


def test_an_answer_reads_every_card_s_offers_in_one_statement(auth_api, make_node, offers_cache):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    # Given offers of three cards, three nodes each
    for card in ("a100-sxm4-80gb", "h100-sxm5-80gb", "a100-sxm4-40gb"):
        for price in ("2.00", "2.50", "3.00"):
            make_node(card=card, price=price)
    # When an answer is asked with the offers cache on
    with CaptureQueriesContext(connection) as first_queries:
        first = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    # Then one statement read every card's offers, and the answer plans on all three cards
    assert len([q for q in first_queries if "card_rank" in q["sql"]]) == 1
    assert {p["card"] for p in first} == {"a100-sxm4-80gb", "h100-sxm5-80gb", "a100-sxm4-40gb"}
    # And the next answer reads them from the cache: no offers statement, the same plans
    with CaptureQueriesContext(connection) as again_queries:
        again = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    assert not [q for q in again_queries if "card_rank" in q["sql"]]
    assert again == first


def test_answers_read_the_offers_cache_and_bookings_the_offers_now(
    auth_api, eight_nodes, offers_cache
):
    from marketplace.models import NodeStatus

    # Given an answer with the cache on: its card's offers are stored
    first = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    assert [p["id"] for p in first if p["gpus"] == 24] == ["a100-sxm4-40gb:3x8"]
    assert list(offers_cache.scan_iter("gpumarket:offers:*"))
    # When six of the eight nodes go offline
    Node.objects.filter(pk__in=[n.pk for n in eight_nodes[:6]]).update(status=NodeStatus.OFFLINE)
    # Then an answer within the cache's TTL still shows the plans of the offers it read
    again = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    assert [p["id"] for p in again] == [p["id"] for p in first]
    # But booking prices the plan on the offers free now: two nodes cannot hold it, and no
    # rental is stored, whether the plan or only its card is named
    for named in ({"plan": "a100-sxm4-40gb:3x8"}, {"card": "a100-sxm4-40gb"}):
        r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, **named}, format="json")
        assert r.status_code == 409, r.content
    assert Rental.objects.count() == 0
