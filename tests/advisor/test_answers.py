"""Answers a person can use: a short list with flags that mean what they say, runs longer than a
booking offered as a series and never booked cut short, inconsistent input refused with the field
at fault, and a booking that runs the plan it booked (model, layout, steps, data)."""

import math

import pytest

from advisor.engine.pricing import MAX_BOOKED_S, PLANS_PER_CARD
from harness.config import load_config_dict, resolve_layout
from marketplace.models import Rental
from storage.models import Dataset, DatasetStatus
from tests.factories import personal_team

pytestmark = pytest.mark.django_db

# 35 B parameters, 48 layers of width 8192 (tests/advisor/test_api.py): a 3 x 8 gang of 40 GB
# cards with ZeRO-3 and full recomputation.
NEEDS_17 = {
    "params_b": 35,
    "layers": 48,
    "hidden": 8192,
    "heads": 64,
    "seq_len": 1024,
    "global_batch": 256,
    "tokens_b": 10,
}
# GPT-2 124M on a million billion tokens: centuries on any free GPUs.
ABSURD = {"model": "gpt2-124m", "tokens_b": 1_000_000}


@pytest.fixture
def eight_nodes(make_node):
    return [make_node(card="a100-sxm4-40gb", price="1.00") for _ in range(8)]


@pytest.fixture
def consumer_cards(make_node):
    return [make_node(card="rtx4090-24gb", gpus=4, price="0.40") for _ in range(2)]


def test_adam_is_accepted_as_adamw(api):
    # Given the same run asked with adam and with adamw
    body = {"model": "llama2-7b", "dp": 8, "zero_stage": 2}
    adam = api.post("/api/v1/advisor/memory/", {**body, "optimizer": "adam"}, format="json")
    adamw = api.post("/api/v1/advisor/memory/", {**body, "optimizer": "adamw"}, format="json")
    # Then both are answered, with the same memory
    assert adam.status_code == 200, adam.content
    assert adam.json() == adamw.json()


@pytest.mark.parametrize(
    "shape",
    [
        # 80 layers of width 8192 are about 65 B parameters, not 7 B
        {"params_b": 7, "layers": 80, "hidden": 8192, "heads": 64},
        # 32 layers of width 4096 with a 4 x MLP are about 8.6 B, not 5 B
        {"params_b": 5, "layers": 32, "hidden": 4096, "heads": 32, "ffn_hidden": 16384},
    ],
)
def test_params_b_contradicting_the_shape_is_refused_naming_params_b(auth_api, shape):
    r = auth_api.post("/api/v1/advisor/", {**shape, "tokens_b": 1}, format="json")
    assert r.status_code == 400, r.content
    assert list(r.json()) == ["params_b"]
    assert "B parameters" in r.json()["params_b"][0]


def test_params_b_within_the_tolerance_of_the_shape_is_accepted(api):
    # Llama 2 7B's shape with its rounded size: the MLP width is fitted to 7 B
    body = {"params_b": 7, "layers": 32, "hidden": 4096, "heads": 32, "tokens_b": 1}
    r = api.post("/api/v1/advisor/", body, format="json")
    assert r.status_code == 200, r.content


@pytest.mark.parametrize(("extra", "field"), [({"tp": 3}, "tp"), ({"pp": 3}, "pp")])
def test_a_bad_tp_or_pp_is_reported_against_itself_not_dp(api, extra, field):
    body = {"model": "llama2-7b", "tokens_b": 1, "card": "a100-sxm4-80gb", "gpus": 8, **extra}
    r = api.post("/api/v1/advisor/estimate/", body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json() and "dp" not in r.json()


def test_a_layout_the_harness_cannot_run_is_refused_naming_its_field(api):
    # ZeRO-1 does not exist in the harness; fp16 cards run plain data parallelism only
    zero1 = {"model": "llama2-7b", "tokens_b": 1, "card": "a100-sxm4-80gb", "gpus": 8}
    r = api.post("/api/v1/advisor/estimate/", {**zero1, "zero_stage": 1}, format="json")
    assert r.status_code == 400 and "zero_stage" in r.json(), r.content
    fp16 = {"model": "gpt2-124m", "tokens_b": 1, "card": "v100-sxm2-32gb", "gpus": 8, "tp": 2}
    r = api.post("/api/v1/advisor/estimate/", fp16, format="json")
    assert r.status_code == 400 and "precision" in r.json(), r.content


def test_an_estimate_that_does_not_fit_says_so_instead_of_hours(api):
    body = {"model": "llama2-70b", "tokens_b": 1, "card": "rtx4090-24gb", "gpus": 1}
    r = api.post("/api/v1/advisor/estimate/", body, format="json")
    assert r.status_code == 200, r.content
    answer = r.json()
    assert answer["fits"] is False
    assert answer["hours"] is None and answer["gpu_hours"] is None
    assert answer["message"].startswith("does not fit: ")


def test_an_estimate_that_fits_has_hours_and_no_message(api):
    body = {"model": "gpt2-124m", "tokens_b": 1, "card": "a100-sxm4-80gb", "gpus": 8}
    answer = api.post("/api/v1/advisor/estimate/", body, format="json").json()
    assert answer["fits"] is True and answer["message"] is None and answer["hours"] > 0


def test_the_answer_is_a_short_list_per_card(api, make_node):
    # Given two cards with many gang sizes free
    for _ in range(8):
        make_node(card="a100-sxm4-40gb", price="1.00")
    for _ in range(4):
        make_node(card="h100-sxm5-80gb", price="2.50", nvlink=True)
    # When a small model is asked about
    r = api.post("/api/v1/advisor/", {"model": "gpt2-124m", "tokens_b": 10}, format="json")
    plans = r.json()["plans"]
    # Then each card offers only its few best plans, and every flag is given once
    per_card = {}
    for plan in plans:
        per_card[plan["card"]] = per_card.get(plan["card"], 0) + 1
    assert set(per_card) == {"a100-sxm4-40gb", "h100-sxm5-80gb"}
    assert all(1 <= n <= PLANS_PER_CARD for n in per_card.values())
    for flag in ("cheapest", "fastest", "best_value"):
        assert sum(flag in p["flags"] for p in plans) == 1


def test_absurd_runs_get_no_plan_flagged_and_a_clear_message(api, consumer_cards):
    r = api.post("/api/v1/advisor/", ABSURD, format="json")
    assert r.status_code == 200, r.content
    answer = r.json()
    assert answer["plans"], "offered as a series of bookings, not dropped"
    limit_h = MAX_BOOKED_S / 3600
    for plan in answer["plans"]:
        assert plan["flags"] == []
        assert plan["hours"] > limit_h
        assert plan["bookings"] == math.ceil(plan["hours"] / limit_h)
        assert any(
            f"series of {plan['bookings']} bookings" in note and "checkpoint" in note
            for note in plan["notes"]
        )
    assert any(reason.startswith("no plan fits one booking") for reason in answer["reasons"])


def test_nothing_longer_than_a_booking_is_flagged(api, make_node):
    # Given one card that runs Llama 2 7B on 50 B tokens in weeks on 16 GPUs, months on fewer
    for _ in range(2):
        make_node(card="a100-sxm4-80gb", gpus=8, price="1.00", nvlink=True)
    body = {"model": "llama2-7b", "tokens_b": 50}
    plans = api.post("/api/v1/advisor/", body, format="json").json()["plans"]
    flagged = [p for p in plans if p["flags"]]
    assert flagged and any(p["bookings"] > 1 for p in plans)
    assert all(p["bookings"] == 1 and p["hours"] <= MAX_BOOKED_S / 3600 for p in flagged)


def test_a_plan_longer_than_a_booking_is_refused_not_cut_short(auth_api, consumer_cards):
    plans = auth_api.post("/api/v1/advisor/", ABSURD, format="json").json()["plans"]
    plan = plans[0]
    r = auth_api.post("/api/v1/advisor/book/", {**ABSURD, "plan": plan["id"]}, format="json")
    assert r.status_code == 409, r.content
    message = r.json()["plan"][0]
    assert f"series of {plan['bookings']} bookings" in message and "resume_from" in message
    assert Rental.objects.count() == 0
    # Naming the card books its cheapest plan: refused the same way
    r = auth_api.post("/api/v1/advisor/book/", {**ABSURD, "card": "rtx4090-24gb"}, format="json")
    assert r.status_code == 409 and "series of" in r.json()["card"][0]
    assert Rental.objects.count() == 0


def _loads_and_fits(config: dict, rental: Rental) -> None:
    """The harness accepts the config and its layout on the GPUs the rental books."""
    loaded = load_config_dict(config)
    layout = resolve_layout(
        loaded.layout, rental.gpus_per_node * rental.node_count, rental.gpus_per_node
    )
    assert layout.world_size == rental.gpus_per_node * rental.node_count


def test_booking_runs_the_planned_shape_layout_and_tokens(auth_api, eight_nodes):
    # Given the plan of a custom 35 B model on a 3 x 8 gang
    plans = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    plan = next(p for p in plans if p["gpus"] == 24)
    # When it is booked
    r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": plan["id"]}, format="json")
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    config = rental.harness_config
    # Then the rental runs that model, in that layout, for the tokens asked
    model = config["model"]
    assert model["name"] == "transformer" and "preset" not in model
    assert (model["layers"], model["hidden"], model["heads"], model["seq_len"]) == (
        48,
        8192,
        64,
        1024,
    )
    assert abs(model["layers"] * 3 * 8192 * model["ffn_hidden"]) > 0
    layout = config["layout"]
    assert layout == plan["runs"]
    assert layout["dp"] * layout["tp"] * layout["pp"] == 24
    global_batch = layout["dp"] * layout["micro_batch"] * layout["grad_accum"]
    assert global_batch == 256
    assert config["train"]["steps"] == math.ceil(10e9 / (global_batch * 1024))
    assert config["train"]["precision"] == "bf16"
    assert config["data"] == {
        "name": "tokens",
        "seq_len": 1024,
        "batch_size": layout["micro_batch"],
    }
    assert rental.advisor_estimate["layout"]["dp"] == layout["dp"]
    _loads_and_fits(config, rental)


def test_booking_a_preset_names_it_and_reads_the_teams_dataset(auth_api, user, consumer_cards):
    # Given a ready dataset of token files of the customer's team
    Dataset.objects.create(
        team=personal_team(user), owner=user, name="corpus", status=DatasetStatus.READY
    )
    body = {"model": "gpt2-124m", "tokens_b": 0.5, "card": "rtx4090-24gb", "dataset": "corpus"}
    # When the card's cheapest plan is booked with it
    r = auth_api.post("/api/v1/advisor/book/", body, format="json")
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    config = rental.harness_config
    # Then the run trains the preset by name on that dataset, mounted for the rental
    assert config["model"] == {"name": "transformer", "preset": "gpt2-124m"}
    assert config["data"]["path"] == "corpus" and config["data"]["dtype"] == "uint16"
    assert r.json()["datasets"] == ["corpus"]
    _loads_and_fits(config, rental)


def test_booking_with_a_dataset_the_team_lacks_stores_nothing(auth_api, consumer_cards):
    body = {"model": "gpt2-124m", "tokens_b": 0.5, "card": "rtx4090-24gb", "dataset": "nope"}
    r = auth_api.post("/api/v1/advisor/book/", body, format="json")
    assert r.status_code == 400 and "datasets" in r.json(), r.content
    assert Rental.objects.count() == 0


def test_a_plan_the_harness_would_refuse_is_400_naming_the_field(auth_api, consumer_cards):
    # A context of one token: the harness needs windows of at least two
    body = {"model": "gpt2-124m", "tokens_b": 0.1, "card": "rtx4090-24gb", "seq_len": 1}
    r = auth_api.post("/api/v1/advisor/book/", body, format="json")
    assert r.status_code == 400, r.content
    assert "seq_len" in r.json() and "the harness cannot run" in r.json()["seq_len"][0]
    assert Rental.objects.count() == 0


def test_the_rental_page_shows_the_plan_it_runs(auth_api, client, user, eight_nodes):
    plans = auth_api.post("/api/v1/advisor/", NEEDS_17, format="json").json()["plans"]
    plan = next(p for p in plans if p["gpus"] == 24)
    r = auth_api.post("/api/v1/advisor/book/", {**NEEDS_17, "plan": plan["id"]}, format="json")
    rental = Rental.objects.get(pk=r.json()["id"])
    layout = rental.harness_config["layout"]
    client.force_login(user)
    page = client.get(f"/rentals/{rental.pk}/").content.decode()
    assert 'id="plan"' in page
    times = "\N{MULTIPLICATION SIGN}"
    assert f"dp {layout['dp']} {times} tp {layout['tp']} {times} pp {layout['pp']}" in page
    assert f"{rental.harness_config['train']['steps']} steps in bf16" in page
    assert "built-in tokens" in page


def test_a_plan_longer_than_a_booking_is_booked_as_a_series_when_asked(auth_api, consumer_cards):
    plan = auth_api.post("/api/v1/advisor/", ABSURD, format="json").json()["plans"][0]
    body = {**ABSURD, "plan": plan["id"], "series": True}
    # When the first booking of the series is asked for
    r = auth_api.post("/api/v1/advisor/book/", body, format="json")
    # Then it books the longest booking, trains the whole run's steps, and says what comes next
    assert r.status_code == 201, r.content
    first = Rental.objects.get(pk=r.json()["id"])
    assert first.duration_s == MAX_BOOKED_S
    assert first.advisor_estimate["bookings"] == plan["bookings"]
    assert f"series of {plan['bookings']}" in r.json()["message"]
    assert f"resume_from: {first.pk}" in r.json()["message"]
    # And the next one resumes from it
    r = auth_api.post(
        "/api/v1/advisor/book/", {**body, "resume_from": str(first.pk)}, format="json"
    )
    assert r.status_code == 201, r.content
    assert Rental.objects.get(pk=r.json()["id"]).resume_from_id == first.pk
