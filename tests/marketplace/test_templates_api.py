"""Rental templates: a team saves what runs by name, and a rental starts from it."""

import pytest
from rest_framework.test import APIClient

from accounts.services import api_token_create
from marketplace.models import Rental, RentalTemplate
from tests.factories import UserFactory, personal_team

pytestmark = pytest.mark.django_db

TEMPLATE = {
    "name": "gpt-text",
    "description": "the harness's GPT on the bundled text",
    "image": "gpumarket/harness:dev",
    "harness_config": {"model": {"name": "gpt"}, "data": {"name": "text"}},
    "env": {"WANDB_MODE": "offline", "LOG_LEVEL": "info"},
    "ports": [8888],
    "ssh": False,
}
RENT = {"gpus_per_node": 1, "duration_s": 3600, "template": "gpt-text"}


@pytest.fixture
def other_api() -> APIClient:
    other = UserFactory()
    _, raw = api_token_create(user=other, team=personal_team(other), name="t")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_a_template_round_trip_and_a_rental_started_from_it(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    r = auth_api.post("/api/v1/templates/", TEMPLATE, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["name"] == "gpt-text" and r.json()["created_by"]
    listed = auth_api.get("/api/v1/templates/").json()["results"]
    assert [t["name"] for t in listed] == ["gpt-text"]
    shown = auth_api.get("/api/v1/templates/gpt-text/").json()
    assert {k: shown[k] for k in TEMPLATE} == TEMPLATE

    # A rental from it, with one variable of its own and one overridden
    body = {**RENT, "runtime": {"env": {"LOG_LEVEL": "debug", "SEED": "3"}}}
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    assert rental.image == TEMPLATE["image"]
    assert rental.harness_config == TEMPLATE["harness_config"]
    assert rental.env == {"WANDB_MODE": "offline", "LOG_LEVEL": "debug", "SEED": "3"}
    assert rental.ports == [8888]

    # Replaced, then deleted
    changed = {**TEMPLATE, "image": "gpumarket/harness:next", "ports": []}
    r = auth_api.put("/api/v1/templates/gpt-text/", changed, format="json")
    assert r.status_code == 200, r.content
    assert RentalTemplate.objects.get(name="gpt-text").image == "gpumarket/harness:next"
    assert auth_api.delete("/api/v1/templates/gpt-text/").status_code == 204
    assert auth_api.get("/api/v1/templates/gpt-text/").status_code == 404
    r = auth_api.post("/api/v1/rentals/", RENT, format="json")
    assert r.status_code == 400 and "template" in r.json()
    assert Rental.objects.count() == 1


def test_a_name_is_saved_once(auth_api):
    assert auth_api.post("/api/v1/templates/", TEMPLATE, format="json").status_code == 201
    again = auth_api.post("/api/v1/templates/", {**TEMPLATE, "image": "x:1"}, format="json")
    assert again.status_code == 409 and "name" in again.json()
    assert RentalTemplate.objects.get().image == TEMPLATE["image"]


def test_another_team_s_template_is_not_found_and_not_usable(auth_api, other_api, make_node):
    make_node(card="a100-sxm4-80gb")
    assert auth_api.post("/api/v1/templates/", TEMPLATE, format="json").status_code == 201
    assert other_api.get("/api/v1/templates/gpt-text/").status_code == 404
    put = other_api.put("/api/v1/templates/gpt-text/", TEMPLATE, format="json")
    assert put.status_code == 200
    # The other team's PUT made a template of its own; ours is unchanged.
    assert RentalTemplate.objects.filter(name="gpt-text").count() == 2
    assert other_api.delete("/api/v1/templates/nope/").status_code == 404
    assert other_api.get("/api/v1/templates/").json()["count"] == 1
    r = other_api.post("/api/v1/rentals/", {**RENT, "template": "missing"}, format="json")
    assert r.status_code == 400 and "template" in r.json()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**TEMPLATE, "name": "Not a slug!"}, "name"),
        ({**TEMPLATE, "name": "x" * 41}, "name"),
        ({k: v for k, v in TEMPLATE.items() if k != "name"}, "name"),
        ({k: v for k, v in TEMPLATE.items() if k != "image"}, "image"),
        ({**TEMPLATE, "image": "UPPER/case"}, "image"),
        ({**TEMPLATE, "env": {"GPUMARKET_X": "1"}}, "env"),
        ({**TEMPLATE, "env": {"A": "\x00"}}, "env"),
        ({**TEMPLATE, "ports": [70000]}, "ports"),
        ({**TEMPLATE, "harness_config": {"train": {"stpes": 1}}}, "harness_config"),
        ({**TEMPLATE, "description": "d" * 201}, "description"),
        ({**TEMPLATE, "surprise": 1}, "surprise"),
    ],
)
def test_a_bad_template_is_a_400_naming_the_field_and_nothing_is_saved(auth_api, body, field):
    r = auth_api.post("/api/v1/templates/", body, format="json")
    assert r.status_code == 400, r.content
    assert field in r.json(), r.json()
    assert not RentalTemplate.objects.exists()


def test_a_rental_from_a_template_is_checked_like_any_other(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    assert auth_api.post("/api/v1/templates/", TEMPLATE, format="json").status_code == 201
    for body, field in [
        ({**RENT, "template": ["gpt-text"]}, "template"),
        ({**RENT, "runtime": "nope"}, "runtime"),
        ({**RENT, "runtime": {"ports": [0]}}, "runtime"),
    ]:
        r = auth_api.post("/api/v1/rentals/", body, format="json")
        assert r.status_code == 400 and field in r.json(), (body, r.content)
    assert not Rental.objects.exists()
