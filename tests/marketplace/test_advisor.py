"""The advisor: which card, how many, how long, what cost — hand-computed — and one-step booking."""

from decimal import Decimal

import pytest

from marketplace.models import Rental, RentalStatus

pytestmark = pytest.mark.django_db

# llama-7b: 6.7e9 parameters x 16 bytes = 107.2 GB of training states; 1e9 tokens.
# Compute: 6 x 6.7e9 x 1e9 = 4.02e19 FLOPs.
# H100 80 GB: 64 GB usable -> 2 GPUs (ZeRO-3, 53.6 GB each), 989 x 0.40 x 2 = 791.2 TFLOPS
#   -> 50,809 s = 14.11 h; 2 x $2.50 x 14.11 h = $70.57.
# A100 40 GB: 32 GB usable -> 4 GPUs (26.8 GB each), 312 x 0.40 x 4 = 499.2 TFLOPS
#   -> 22.37 h; 4 x $1.00 x 22.37 h = $89.48.
# RTX 4090 24 GB: 19.2 GB usable -> 6 GPUs; the only node has 4: no option.
QUERY = {"model": "llama-7b", "tokens_b": 1}


@pytest.fixture
def fleet(make_node):
    return {
        "h100": make_node(card="h100-sxm5-80gb", price="2.50", nvlink=True, region="eu-west"),
        "a100": make_node(card="a100-sxm4-40gb", price="1.00", nvlink=True, region="eu-west"),
        "4090": make_node(card="rtx4090-24gb", gpus=4, price="0.40", region="eu-west"),
    }


def test_the_advisor_ranks_cards_by_total_cost_from_live_offers(api, fleet):
    r = api.post("/api/v1/advisor/", QUERY, format="json")
    assert r.status_code == 200, r.content
    options = r.json()["options"]
    assert [(o["card"], o["gpus"], o["strategy"]) for o in options] == [
        ("h100-sxm5-80gb", 2, "zero3"),
        ("a100-sxm4-40gb", 4, "zero3"),
    ]
    h100, a100 = options
    assert (h100["memory_per_gpu_gb"], h100["effective_tflops"], h100["hours"]) == (
        53.6,
        791.2,
        14.11,
    )
    assert (h100["cost"], a100["cost"], a100["hours"]) == ("70.57", "89.48", 22.37)


def test_a_small_model_fits_one_gpu_and_the_cheapest_card_wins(api, fleet):
    # gpt2-small, 124M params: 2 GB of states, fits every card. 10B tokens:
    # 6 x 0.124e9 x 10e9 = 7.44e18 FLOPs; RTX 4090 165.2 x 0.4 = 66.08 TFLOPS -> 31.28 h x $0.40.
    r = api.post("/api/v1/advisor/", {"model": "gpt2-small", "tokens_b": 10}, format="json")
    best = r.json()["options"][0]
    assert (best["card"], best["gpus"], best["strategy"], best["hours"]) == (
        "rtx4090-24gb",
        1,
        "ddp",
        31.28,
    )
    assert best["cost"] == "12.52"


def test_bf16_falls_back_to_fp16_on_cards_without_it(api, make_node):
    make_node(card="v100-sxm2-32gb", price="0.50")
    [v100] = api.post("/api/v1/advisor/", {"params_b": 0.5, "tokens_b": 1}, format="json").json()[
        "options"
    ]
    assert v100["precision"] == "fp16"
    assert any("no bf16" in note for note in v100["notes"])


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tokens_b": 1}, "model"),
        ({"model": "llama-7b", "params_b": 7, "tokens_b": 1}, "model"),
        ({"model": "gpt-5", "tokens_b": 1}, "model"),
        ({"model": "llama-7b"}, "tokens_b"),
        ({"model": "llama-7b", "tokens_b": -1}, "tokens_b"),
        ({"model": "llama-7b", "tokens_b": 1, "precision": "int4"}, "precision"),
        ({"model": "llama-7b", "tokens_b": 1, "gpus": 8}, "gpus"),
    ],
)
def test_bad_advisor_input_is_400_naming_the_field(api, fleet, body, field):
    r = api.post("/api/v1/advisor/", body, format="json")
    assert r.status_code == 400 and field in r.json()


def test_an_option_is_booked_in_one_step(auth_api, fleet):
    r = auth_api.post("/api/v1/advisor/book/", {**QUERY, "card": "h100-sxm5-80gb"}, format="json")
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    assert (rental.gpu_models, rental.gpus_per_node, rental.node_count, rental.same_group) == (
        ["h100-sxm5-80gb"],
        2,
        1,
        True,
    )
    assert rental.max_price_per_gpu_hour == Decimal("2.5000")
    # Booked time: the 14.11 h estimate plus a fifth = 1015.92 min -> 1016 whole minutes.
    assert rental.duration_s == 60960
    assert rental.status == RentalStatus.PENDING
    assert rental.harness_config == {"model": {"name": "gpt"}, "data": {"name": "text"}}


def test_booking_a_card_with_no_free_offer_is_409_and_stores_nothing(auth_api, fleet):
    r = auth_api.post("/api/v1/advisor/book/", {**QUERY, "card": "rtx4090-24gb"}, format="json")
    assert r.status_code == 409 and "card" in r.json()
    assert Rental.objects.count() == 0


def test_booking_needs_an_account(api, fleet):
    r = api.post("/api/v1/advisor/book/", {**QUERY, "card": "h100-sxm5-80gb"}, format="json")
    assert r.status_code == 401
    assert Rental.objects.count() == 0
