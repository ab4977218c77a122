"""Hostile and careless input: each answer is a 4xx that names what it refused, and nothing is
written. Each case was a 500 (or worse) before the guard."""

from __future__ import annotations

import json

import pytest

from accounts.models import ApiToken
from marketplace.models import Rental, RentalEvent

pytestmark = pytest.mark.django_db

RUNTIME = {"image": "gpumarket/harness:dev"}
RENTAL = {"name": "run", "gpus_per_node": 1, "duration_s": 3600, "runtime": RUNTIME}


@pytest.fixture
def rental(make_node, rent):
    make_node()
    return rent(1)


@pytest.fixture
def snapshot():
    """The rows a refused request could have written."""

    def take():
        return (Rental.objects.count(), RentalEvent.objects.count(), ApiToken.objects.count())

    return take


def _refused(response, status: int, field: str) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert field in body, body
    return body


# NUL, in each place a client can put one.


def test_nul_in_a_path_segment_is_a_400_naming_the_path(auth_api):
    _refused(auth_api.get("/api/v1/gpu-models/%00/"), 400, "path")
    _refused(auth_api.get("/api/v1/gpu-models/a100%00x/"), 400, "path")


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/api/v1/rentals/{id}/metrics/?event=%00", "event"),
        ("/api/v1/offers/?region=eu%00", "region"),
        ("/api/v1/rentals/?status=%00", "status"),
        ("/api/v1/billing/rentals/{id}/telemetry/?gpu_index=1%00", "gpu_index"),
        ("/api/v1/gpu-models/?family=%00", "family"),
    ],
)
def test_nul_in_a_query_parameter_is_a_400_naming_it(auth_api, rental, url, field):
    _refused(auth_api.get(url.format(id=rental.pk)), 400, field)


def test_nul_in_a_query_parameter_name_is_refused(auth_api):
    _refused(auth_api.get("/api/v1/offers/?re%00gion=eu"), 400, "query")


def test_nul_in_a_header_is_refused(api):
    r = api.get("/api/v1/offers/", HTTP_X_REQUEST_ID="a\x00b")
    _refused(r, 400, "x-request-id")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**RENTAL, "name": "x\x00"}, "name"),
        ({**RENTAL, "runtime": {**RUNTIME, "env": {"A": "b\x00"}}}, "runtime"),
        ({**RENTAL, "runtime": {**RUNTIME, "env": {"A\x00": "b"}}}, "runtime"),
        ({**RENTAL, "runtime": {**RUNTIME, "command": ["sh", "-c", "\x00"]}}, "runtime"),
        (
            {**RENTAL, "runtime": {**RUNTIME, "harness_config": {"model": {"name": "g\x00pt"}}}},
            "runtime",
        ),
    ],
)
def test_nul_in_any_json_string_is_a_400_and_nothing_is_written(
    auth_api, make_node, snapshot, body, field
):
    make_node()
    before = snapshot()
    body = _refused(auth_api.post("/api/v1/rentals/", body, format="json"), 400, field)
    assert "NUL" in json.dumps(body)
    assert snapshot() == before


def test_nul_in_a_token_name_is_refused(auth_api, snapshot):
    before = snapshot()
    _refused(auth_api.post("/api/v1/tokens/", {"name": "a\x00b"}, format="json"), 400, "name")
    assert snapshot() == before


# The shape and size of a body.


@pytest.mark.parametrize("depth", [65, 1_000, 50_000])
def test_json_nested_too_deep_is_a_400(auth_api, snapshot, depth):
    before = snapshot()
    deep = "[" * depth + "]" * depth
    r = auth_api.post("/api/v1/rentals/", deep, content_type="application/json")
    body = _refused(r, 400, "body")
    assert "64 levels" in body["body"][0]
    assert snapshot() == before


def test_json_nested_too_deep_inside_a_field_names_the_field(auth_api, make_node, snapshot):
    make_node()
    config: dict = {}
    node = config
    for _ in range(70):
        node["a"] = {}
        node = node["a"]
    before = snapshot()
    r = auth_api.post(
        "/api/v1/rentals/",
        {**RENTAL, "runtime": {**RUNTIME, "harness_config": config}},
        format="json",
    )
    assert "levels deep" in _refused(r, 400, "runtime")["runtime"][0]
    assert snapshot() == before


def test_a_body_over_the_limit_is_a_413(auth_api, settings, snapshot):
    settings.API_MAX_BODY_BYTES = 4096
    before = snapshot()
    body = json.dumps({"name": "x" * 5000})
    r = auth_api.post("/api/v1/tokens/", body, content_type="application/json")
    assert r.status_code == 413 and "4096 bytes" in r.json()["detail"]
    assert snapshot() == before


def test_a_form_body_is_a_415(auth_api, snapshot):
    before = snapshot()
    r = auth_api.post("/api/v1/tokens/", "name=x", content_type="application/x-www-form-urlencoded")
    assert r.status_code == 415
    assert snapshot() == before


@pytest.mark.parametrize("text", ["NaN", "Infinity", '{"name": "x"', "\xff"])
def test_what_is_not_json_is_a_400(auth_api, snapshot, text):
    before = snapshot()
    r = auth_api.post("/api/v1/tokens/", text.encode("latin-1"), content_type="application/json")
    assert r.status_code == 400, r.content
    assert snapshot() == before


# Numbers and dates past what the columns hold.


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("after_step=--5", "after_step"),
        ("after_step=99999999999999999999", "after_step"),
        ("after_step=1e3", "after_step"),
    ],
)
def test_metrics_query_is_validated(auth_api, rental, query, field):
    _refused(auth_api.get(f"/api/v1/rentals/{rental.pk}/metrics/?{query}"), 400, field)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("until=0001-01-01T00:00:00Z", "until"),
        ("since=0001-01-01T00:00:00Z", "since"),
        ("until=9999-12-31T23:59:59Z", "until"),
        ("since=1970-01-01T00:00:00Z&until=1970-01-02T00:00:00Z", "since"),
        ("until=not-a-date", "until"),
        ("gpu_index=4294967296", "gpu_index"),
    ],
)
def test_telemetry_query_is_validated(auth_api, rental, query, field):
    url = f"/api/v1/billing/rentals/{rental.pk}/telemetry/?{query}"
    _refused(auth_api.get(url), 400, field)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("min_memory_gb=99999999999999999999", "min_memory_gb"),
        ("min_free_gpus=9223372036854775808", "min_free_gpus"),
        ("ordering=nope", "ordering"),
        ("offset=99999999999999999999", "offset"),
    ],
)
def test_offer_query_is_validated(api, query, field):
    _refused(api.get(f"/api/v1/offers/?{query}"), 400, field)


def test_rental_list_status_must_be_one_of_its_choices(auth_api):
    _refused(auth_api.get("/api/v1/rentals/?status=flying"), 400, "status")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"min_memory_gb": 2**31}, "min_memory_gb"),
        ({"min_memory_gb": 2**63}, "min_memory_gb"),
        ({"gpus_per_node": 2**64}, "gpus_per_node"),
        ({"duration_s": 2**40}, "duration_s"),
        ({"start_at": "0001-01-01T00:00:00Z"}, "start_at"),
        ({"start_at": "9999-12-31T23:59:59Z"}, "start_at"),
        ({"start_deadline": "1969-12-31T23:59:59Z"}, "start_deadline"),
        ({"max_price_per_gpu_hour": "1e30"}, "max_price_per_gpu_hour"),
        ({"runtime": {**RUNTIME, "ports": [2**31]}}, "runtime"),
    ],
)
def test_rental_numbers_and_dates_past_their_columns_are_refused(
    auth_api, make_node, snapshot, change, field
):
    make_node()
    before = snapshot()
    _refused(auth_api.post("/api/v1/rentals/", {**RENTAL, **change}, format="json"), 400, field)
    assert snapshot() == before


@pytest.mark.parametrize(
    "expires_at", ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59-23:00", "1970-01-01T00:00:00Z"]
)
def test_token_expiry_out_of_range_is_refused(auth_api, snapshot, expires_at):
    before = snapshot()
    r = auth_api.post("/api/v1/tokens/", {"name": "x", "expires_at": expires_at}, format="json")
    _refused(r, 400, "expires_at")
    assert snapshot() == before


def test_huge_ids_in_paths_are_a_404(auth_api):
    for url in (
        "/api/v1/tokens/99999999999999999999999/revoke/",
        "/api/v1/billing/invoices/99999999999999999999999/",
        "/api/v1/providers/99999999999999999999999/nodes/",
        "/api/v1/providers/nodes/-1/",
    ):
        r = auth_api.post(url) if url.endswith("revoke/") else auth_api.get(url)
        assert r.status_code == 404, (url, r.content)
        assert r["Content-Type"] == "application/json"


# The advisor: the largest inputs it takes give an answer, and beyond them a 400.


def test_the_largest_advisor_inputs_are_answered(api, make_node):
    make_node(card="v100-sxm2-16gb", gpus=8, price="999999.9999")
    r = api.post(
        "/api/v1/advisor/",
        {"params_b": 1, "tokens_b": 1_000_000, "precision": "fp32"},
        format="json",
    )
    assert r.status_code == 200, r.content
    body = r.json()
    # A cost past what a plan can carry is an explained empty answer, never a 500.
    assert body["plans"] == [] and body["reasons"], body


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tokens_b": 1e308}, "tokens_b"),
        ({"tokens_b": 1_000_001}, "tokens_b"),
        ({"params_b": 1e300}, "params_b"),
        ({"tokens_b": "1e999"}, "tokens_b"),
    ],
)
def test_advisor_inputs_past_their_range_are_a_400(api, change, field):
    body = {"params_b": 7, "tokens_b": 1, **change}
    _refused(api.post("/api/v1/advisor/", body, format="json"), 400, field)


def test_advisor_book_with_huge_inputs_writes_nothing(auth_api, make_node, snapshot):
    make_node(card="v100-sxm2-16gb", gpus=8)
    before = snapshot()
    r = auth_api.post(
        "/api/v1/advisor/book/",
        {"params_b": 2000, "tokens_b": 1e12, "card": "v100-sxm2-16gb"},
        format="json",
    )
    _refused(r, 400, "tokens_b")
    assert snapshot() == before


# The last line of defence: a database error in a view is a 4xx, not a 500.


def test_a_database_error_that_escapes_validation_is_a_400_not_a_500(rf, user):
    from django.db import DataError
    from rest_framework.views import APIView

    from core.api.exceptions import exception_handler

    response = exception_handler(DataError("value too long"), {"view": APIView()})
    assert response.status_code == 400 and response.data["code"] == "invalid"
