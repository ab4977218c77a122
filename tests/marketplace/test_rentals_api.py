"""The rentals API: create, validation, refusal of what can never fit, ownership, cancel, stop."""

import pytest

from accounts.services import api_token_create
from marketplace.models import Rental, RentalEvent, RentalStatus
from scheduler.services import scheduler_cycle_run
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

BODY = {
    "name": "llm-finetune",
    "gpu_families": ["a100"],
    "gpus_per_node": 4,
    "same_group": True,
    "region": "eu",
    "max_price_per_gpu_hour": "2.00",
    "duration_s": 7200,
    "runtime": {
        "image": "gpumarket/harness:dev",
        "harness_config": {"model": {"name": "gpt"}, "data": {"name": "text"}},
        "env": {"WANDB_MODE": "offline"},
        "ports": [8888],
    },
}


@pytest.fixture
def node(make_node):
    return make_node(card="a100-sxm4-80gb", region="eu-west", price="1.50", nvlink=True,
                     group_size=4)  # fmt: skip


def test_create_stores_a_pending_rental_with_its_first_event(auth_api, user, node):
    r = auth_api.post("/api/v1/rentals/", BODY, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "pending"
    assert [e["to_status"] for e in body["events"]] == ["pending"]
    rental = Rental.objects.get(pk=body["id"])
    assert (rental.customer, rental.gpus_per_node, rental.region) == (user, 4, "eu")
    assert rental.env == {"WANDB_MODE": "offline"} and rental.ports == [8888]
    scheduler_cycle_run()
    detail = auth_api.get(f"/api/v1/rentals/{rental.pk}/").json()
    assert detail["status"] == "scheduled"
    assert detail["price_per_gpu_hour"] == "1.5000"
    assert [a["gpu_index"] for a in detail["allocations"]] == [0, 1, 2, 3]


def test_end_at_gives_the_duration(auth_api, node):
    body = {k: v for k, v in BODY.items() if k != "duration_s"}
    body["start_at"] = "2099-01-01T00:00:00Z"
    body["end_at"] = "2099-01-01T02:00:00Z"
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    # 2099 is beyond the planning horizon: refused, naming the field.
    assert r.status_code == 400 and "start_at" in r.json()


def test_a_booking_is_accepted_only_as_far_ahead_as_it_is_guaranteed(auth_api, node):
    # Given the planner's horizon (48 h), when a booking starts an hour inside it, the next
    # cycle places it (GPUs held: guaranteed when made); an hour beyond it is refused with the
    # reason, naming start_at, and nothing is stored.
    from datetime import UTC, datetime, timedelta

    from scheduler.engine import DEFAULT_POLICY

    horizon = timedelta(seconds=DEFAULT_POLICY.horizon)
    assert horizon == timedelta(hours=48)
    now = datetime.now(UTC).replace(microsecond=0)
    inside = {**BODY, "start_at": (now + horizon - timedelta(hours=1)).isoformat()}
    r = auth_api.post("/api/v1/rentals/", inside, format="json")
    assert r.status_code == 201, r.content
    scheduler_cycle_run()
    detail = auth_api.get(f"/api/v1/rentals/{r.json()['id']}/").json()
    assert detail["status"] == "scheduled"
    assert [a["gpu_index"] for a in detail["allocations"]] == [0, 1, 2, 3]

    beyond = {**BODY, "start_at": (now + horizon + timedelta(hours=1)).isoformat()}
    r = auth_api.post("/api/v1/rentals/", beyond, format="json")
    assert r.status_code == 400
    assert r.json()["start_at"] == [
        "start_at is more than 48 h ahead: bookings are planned (and guaranteed) only within "
        "the 48 h planning horizon"
    ]
    assert Rental.objects.count() == 1


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"gpus_per_node": "four"}, "gpus_per_node"),
        ({"max_price_per_gpu_hour": "-1"}, "max_price_per_gpu_hour"),
        ({"kind": "spot"}, "kind"),
        ({"kind": "interruptible"}, "bid_per_gpu_hour"),
        ({"bid_per_gpu_hour": "0.5"}, "bid_per_gpu_hour"),
        ({"duration_s": 10}, "duration_s"),
        ({"region": "eu west"}, "region"),
        ({"gpu_models": ["no-such-card"]}, "gpu_models"),
        ({"start_at": "yesterday"}, "start_at"),
        ({"start_at": "2020-01-01T00:00:00Z"}, "start_at"),
        ({"gpus": 4}, "gpus"),
        ({"runtime": {"image": "Bad Image!"}}, "runtime"),
        ({"runtime": {"image": "x", "ports": [70000]}}, "runtime"),
        ({"runtime": {"image": "x", "env": {"CUDA_VISIBLE_DEVICES": "0"}}}, "runtime"),
    ],
)
def test_bad_input_is_400_naming_the_field_and_stores_nothing(auth_api, node, patch, field):
    r = auth_api.post("/api/v1/rentals/", {**BODY, **patch}, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json()
    assert Rental.objects.count() == 0 and RentalEvent.objects.count() == 0


@pytest.mark.parametrize(
    ("patch", "words"),
    [
        ({"gpus_per_node": 16}, "has 16 matching GPUs"),
        ({"gpu_families": ["h100"]}, "has 4 matching GPUs"),
        ({"region": "us"}, "no node in region us"),
        ({"max_price_per_gpu_hour": "1.00"}, "price"),
        ({"node_count": 2}, "only 1 matching nodes"),
    ],
)
def test_a_request_that_can_never_fit_is_refused_with_the_reason(auth_api, node, patch, words):
    r = auth_api.post("/api/v1/rentals/", {**BODY, **patch}, format="json")
    assert r.status_code == 400
    assert words in r.json()["detail"]
    assert Rental.objects.count() == 0


def test_customers_see_and_touch_only_their_own_rentals(auth_api, node):
    mine = auth_api.post("/api/v1/rentals/", BODY, format="json").json()["id"]
    other = UserFactory()
    _, raw = api_token_create(user=other, team=personal_team(other), name="t")
    from rest_framework.test import APIClient

    theirs = APIClient()
    theirs.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert theirs.get("/api/v1/rentals/").json()["results"] == []
    for method, url in [
        ("get", f"/api/v1/rentals/{mine}/"),
        ("post", f"/api/v1/rentals/{mine}/cancel/"),
        ("post", f"/api/v1/rentals/{mine}/stop/"),
    ]:
        assert getattr(theirs, method)(url).status_code == 404
    assert Rental.objects.get(pk=mine).status == RentalStatus.PENDING
    assert [r["id"] for r in auth_api.get("/api/v1/rentals/").json()["results"]] == [mine]


def test_cancel_frees_the_gpus_and_records_the_event(auth_api, node):
    rental_id = auth_api.post("/api/v1/rentals/", BODY, format="json").json()["id"]
    scheduler_cycle_run()
    r = auth_api.post(f"/api/v1/rentals/{rental_id}/cancel/")
    assert r.status_code == 200
    assert r.json()["status"] == "cancelled"
    assert all(a["released_at"] for a in r.json()["allocations"])
    offers = auth_api.get("/api/v1/offers/").json()["results"]
    assert offers[0]["free_gpus"] == 8
    assert auth_api.post(f"/api/v1/rentals/{rental_id}/cancel/").status_code == 409


def test_stop_of_a_running_rental_asks_the_agent_to_stop(auth_api, node):
    from django.db import transaction

    from marketplace.lifecycle import rental_transition

    rental_id = auth_api.post("/api/v1/rentals/", BODY, format="json").json()["id"]
    scheduler_cycle_run()
    with transaction.atomic():
        rental = Rental.objects.select_for_update().get(pk=rental_id)
        rental_transition(rental=rental, to_status="provisioning", actor_kind="agent")
        rental_transition(rental=rental, to_status="running", actor_kind="agent")
    r = auth_api.post(f"/api/v1/rentals/{rental_id}/stop/")
    assert r.json()["status"] == "stopping"
    assert auth_api.post(f"/api/v1/rentals/{rental_id}/cancel/").status_code == 409


def test_unknown_status_filter_is_400(auth_api):
    r = auth_api.get("/api/v1/rentals/", {"status": "sleeping"})
    assert r.status_code == 400 and "status" in r.json()


def test_a_bad_harness_config_is_400_naming_the_key(auth_api, node):
    body = {**BODY, "runtime": {"image": "x", "harness_config": {"train": {"lr": -1}}}}
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 400
    assert "train.lr" in str(r.json()["runtime"]["harness_config"])
    assert Rental.objects.count() == 0


def test_the_booked_time_must_be_covered_at_the_cheapest_node_that_fits(
    auth_api, user, make_node, settings
):
    from billing.services.ledger import account_adjust, account_for_team

    settings.BILLING_FUNDS_CHECK = True
    make_node(card="a100-sxm4-80gb", price="1.50", region="eu-west")
    make_node(card="a100-sxm4-80gb", price="1.00", region="eu-west")
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=7_990_000,
        reason="test credit",
        actor=None,
    )
    body = {"gpus_per_node": 8, "duration_s": 3600, "runtime": {"image": "img"}}
    # 8 GPUs x $1.00 (the cheapest node that fits) x 1 h = $8.00 held > $7.99.
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 402
    assert "$8.00" in r.json()["detail"]
    assert Rental.objects.count() == 0
    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
        amount_micros=10_000,
        reason="one more cent",
        actor=None,
    )
    assert auth_api.post("/api/v1/rentals/", body, format="json").status_code == 201


def test_each_create_and_answer_holds_only_its_own_body_and_rental(auth_api, node):
    """The create view's serializers are kept per thread (core.api.reuse): a bad body, a
    good one and another good one in a row on one thread each get their own answer."""
    url = "/api/v1/rentals/"
    bad = auth_api.post(url, {**BODY, "gpus_per_node": 0}, format="json")
    assert bad.status_code == 400 and set(bad.json()) == {"gpus_per_node"}
    first = auth_api.post(url, {**BODY, "name": "first"}, format="json")
    assert first.status_code == 201, first.content
    second_body = {**BODY, "name": "second", "runtime": {"image": "other:1"}}
    second = auth_api.post(url, second_body, format="json").json()
    assert (second["name"], second["image"], second["ports"]) == ("second", "other:1", [])
    assert second["harness_config"] is None and second["datasets"] == []
    assert [e["to_status"] for e in second["events"]] == ["pending"]
    assert second["id"] != first.json()["id"]
    assert auth_api.post(url, {**BODY, "typo": 1}, format="json").json() == {
        "typo": ["unknown field"]
    }
    shown = auth_api.get(f"{url}{first.json()['id']}/").json()
    assert (shown["name"], shown["ports"]) == ("first", [8888])
    assert Rental.objects.filter(team__isnull=False).count() == 2


def test_a_kept_serializer_is_one_per_thread():
    import threading

    from marketplace.api.serializers import RentalCreateSerializer, RentalDetailSerializer

    here = RentalCreateSerializer.for_data({})
    assert RentalCreateSerializer.for_data({"a": 1}) is here
    assert RentalDetailSerializer.for_instance(None) is not here
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(RentalCreateSerializer.for_data({})))
    thread.start()
    thread.join()
    assert elsewhere[0] is not here


def test_the_rental_a_create_returns_reads_its_relations_from_the_database(make_node, rent):
    """What a create leaves on the rental it returns, for its own answer, is not a cache its
    callers read later: after placement its GPUs and events are there."""
    make_node()
    rental = rent(2)
    assert list(rental.allocations.all()) == [] and rental.events.count() == 1
    scheduler_cycle_run()
    assert rental.allocations.filter(released_at__isnull=True).count() == 2
    assert [e.to_status for e in rental.events.order_by("id")] == ["pending", "scheduled"]
