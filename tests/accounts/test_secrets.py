"""Team secrets: encrypted at rest, write-only through the API, named by rentals and templates,
handed only to the node that runs the rental, and masked in everything its runs print."""

from __future__ import annotations

import json

import pytest
from cryptography.fernet import Fernet
from django.db import connection
from rest_framework.test import APIClient

from accounts.models import TeamSecret
from accounts.services import api_token_create
from accounts.services.secrets import secret_values, secrets_reencrypt
from marketplace.models import Rental
from provisioning.models import ContainerRun, RunLogLine, RunMetric
from scheduler.services import scheduler_cycle_run
from tests.factories import UserFactory, personal_team
from tests.provisioning.test_agent_api import _beat, agent  # noqa: F401

pytestmark = pytest.mark.django_db

VALUE = "hf_s3cr3t-Value-0123456789"
RENT = {
    "gpus_per_node": 1,
    "duration_s": 3600,
    "runtime": {"image": "gpumarket/harness:dev", "command": ["python", "-c", "pass"]},
}


@pytest.fixture
def other_api() -> APIClient:
    other = UserFactory()
    _, raw = api_token_create(user=other, team=personal_team(other), name="t")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _every_get(client: APIClient, paths: list[str]) -> str:
    """The bodies of GETs of every path, concatenated (each answered 200)."""
    bodies = []
    for path in paths:
        r = client.get(path)
        assert r.status_code == 200, (path, r.content)
        bodies.append(r.content.decode())
    return "\n".join(bodies)


def test_a_secret_is_stored_encrypted_and_no_endpoint_returns_its_value(
    auth_api, make_node, user, client
):
    make_node(card="a100-sxm4-80gb")
    # given a secret set through the API
    r = auth_api.post("/api/v1/secrets/", {"name": "HF_TOKEN", "value": VALUE}, format="json")
    assert r.status_code == 201, r.content
    assert set(r.json()) == {"name", "created_by", "created_at", "updated_at"}
    # then the table holds ciphertext only
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {TeamSecret._meta.db_table}")
        assert VALUE not in repr(cursor.fetchall())
    # when it is replaced by name: 200, one row, the new value
    r = auth_api.post("/api/v1/secrets/", {"name": "HF_TOKEN", "value": VALUE + "2"}, format="json")
    assert r.status_code == 200
    secret = TeamSecret.objects.get()
    assert secret_values(pairs=[(secret.team_id, "HF_TOKEN")]) == {
        (secret.team_id, "HF_TOKEN"): VALUE + "2"
    }
    # when a template and a rental name it
    template = {"name": "t1", "image": "gpumarket/harness:dev", "secrets": ["HF_TOKEN"]}
    assert auth_api.post("/api/v1/templates/", template, format="json").status_code == 201
    r = auth_api.post("/api/v1/rentals/", {**RENT, "secrets": ["HF_TOKEN"]}, format="json")
    assert r.status_code == 201, r.content
    rental_id = r.json()["id"]
    assert r.json()["secrets"] == [{"name": "HF_TOKEN", "env": "HF_TOKEN", "file": ""}]
    # then no GET of secrets, rentals or templates has the value
    body = _every_get(
        auth_api,
        [
            "/api/v1/secrets/",
            "/api/v1/secrets/HF_TOKEN/",
            "/api/v1/rentals/",
            f"/api/v1/rentals/{rental_id}/",
            f"/api/v1/rentals/{rental_id}/logs/",
            "/api/v1/templates/",
            "/api/v1/templates/t1/",
        ],
    )
    client.force_login(user)
    body += _every_get(
        client, ["/secrets/", f"/rentals/{rental_id}/", "/templates/", "/rentals/new/"]
    )
    assert "HF_TOKEN" in body
    assert VALUE not in body
    # and the rental's page names the secret it gets
    page = client.get(f"/rentals/{rental_id}/").content.decode()
    assert '<dd id="secrets"><code>HF_TOKEN</code>' in page
    assert Rental.objects.get(pk=rental_id).env == {}
    # and a rental started from the template gets the secret by name
    r = auth_api.post(
        "/api/v1/rentals/",
        {"gpus_per_node": 1, "duration_s": 3600, "template": "t1"},
        format="json",
    )
    assert r.status_code == 201, r.content
    assert r.json()["secrets"] == [{"name": "HF_TOKEN", "env": "HF_TOKEN", "file": ""}]


def test_bad_names_and_values_are_refused_naming_the_field_and_nothing_is_stored(auth_api):
    for body, field in [
        ({"name": "1BAD", "value": "x"}, "name"),
        ({"name": "HAS-DASH", "value": "x"}, "name"),
        ({"name": "GPUMARKET_X", "value": "x"}, "name"),
        ({"name": "A" * 65, "value": "x"}, "name"),
        ({"name": "OK", "value": ""}, "value"),
        ({"name": "OK", "value": "a\x00b"}, "value"),
        ({"name": "OK", "value": "x" * (64 * 1024 + 1)}, "value"),
        ({"name": "OK"}, "value"),
        ({"name": "OK", "value": "x", "extra": 1}, "extra"),
    ]:
        r = auth_api.post("/api/v1/secrets/", body, format="json")
        assert r.status_code == 400, (body, r.content)
        assert field in json.dumps(r.json()), (body, r.json())
    assert TeamSecret.objects.count() == 0


def test_another_teams_secret_is_not_found_nor_usable(auth_api, other_api, make_node):
    make_node(card="a100-sxm4-80gb")
    auth_api.post("/api/v1/secrets/", {"name": "MINE", "value": VALUE}, format="json")
    assert other_api.get("/api/v1/secrets/MINE/").status_code == 404
    assert other_api.delete("/api/v1/secrets/MINE/").status_code == 404
    assert other_api.get("/api/v1/secrets/").json() == []
    r = other_api.post("/api/v1/rentals/", {**RENT, "secrets": ["MINE"]}, format="json")
    assert r.status_code == 400 and "secrets" in r.json(), r.content
    r = other_api.post("/api/v1/rentals/", {**RENT, "registry_secret": "MINE"}, format="json")
    assert r.status_code == 400 and "registry_secret" in r.json(), r.content
    assert Rental.objects.count() == 0
    assert TeamSecret.objects.count() == 1
    # the owner deletes it
    assert auth_api.delete("/api/v1/secrets/MINE/").status_code == 204
    assert TeamSecret.objects.count() == 0


@pytest.mark.parametrize(
    ("secrets", "why"),
    [
        (["NOPE"], "no secret"),
        ({"HF_TOKEN": {"env": "1X"}}, "variable"),
        ({"HF_TOKEN": {"file": "/etc/passwd"}}, "/run/secrets"),
        ({"HF_TOKEN": {"file": "/run/secrets/../x"}}, "/run/secrets"),
        ({"HF_TOKEN": {"other": 1}}, "env"),
        ("HF_TOKEN", "list"),
    ],
)
def test_a_rental_naming_secrets_badly_is_a_400_on_secrets(auth_api, make_node, secrets, why):
    make_node(card="a100-sxm4-80gb")
    auth_api.post("/api/v1/secrets/", {"name": "HF_TOKEN", "value": VALUE}, format="json")
    r = auth_api.post("/api/v1/rentals/", {**RENT, "secrets": secrets}, format="json")
    assert r.status_code == 400, r.content
    assert why in json.dumps(r.json()["secrets"]), r.json()
    assert Rental.objects.count() == 0


def test_a_registry_secret_must_hold_credentials(auth_api, make_node):
    make_node(card="a100-sxm4-80gb")
    auth_api.post("/api/v1/secrets/", {"name": "REG", "value": "just-a-token"}, format="json")
    r = auth_api.post("/api/v1/rentals/", {**RENT, "registry_secret": "REG"}, format="json")
    assert r.status_code == 400 and "registry_secret" in r.json(), r.content
    assert Rental.objects.count() == 0


def test_the_node_gets_the_values_and_the_server_masks_what_the_agent_did_not(
    agent,  # noqa: F811
    auth_api,
    user,
):
    # given a rental with an env secret, a file secret and registry credentials
    for name, value in [
        ("HF_TOKEN", VALUE),
        ("KEY", "line-one-of-key\nline-two-of-key"),
        ("REG", json.dumps({"username": "me", "password": "reg-p4ssword"})),
    ]:
        auth_api.post("/api/v1/secrets/", {"name": name, "value": value}, format="json")
    body = {
        **RENT,
        "secrets": {"HF_TOKEN": {}, "KEY": {"file": True}},
        "registry_secret": "REG",
    }
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 201, r.content
    rental = Rental.objects.get(pk=r.json()["id"])
    scheduler_cycle_run()
    # when the node asks what to run: the values, for this node only
    [desired] = _beat(agent).json()["desired"]
    assert desired["secrets"] == [
        {"name": "HF_TOKEN", "value": VALUE, "env": "HF_TOKEN"},
        {"name": "KEY", "value": "line-one-of-key\nline-two-of-key", "file": "/run/secrets/KEY"},
    ]
    assert desired["registry_auth"] == {
        "secret": "REG", "username": "me", "password": "reg-p4ssword"
    }  # fmt: skip
    assert "HF_TOKEN" not in desired["env"]
    run_id = desired["run_id"]
    # when an agent that masks nothing forwards lines, a metric and an exit with a tail
    rid = str(rental.pk)
    lines = [f"token={VALUE}", "line-two-of-key", "login reg-p4ssword ok"]
    report = {"rental_id": rid, "run_id": run_id, "status": "running", "started_at": 1.0e9}
    r = _beat(
        agent,
        containers=[report],
        logs=[{"rental_id": rid, "run_id": run_id, "line_no": i, "line": line}
              for i, line in enumerate(lines)],
        metrics=[{"rental_id": rid, "run_id": run_id,
                  "line": json.dumps({"event": "note", "step": 1, "msg": VALUE})}],
    )  # fmt: skip
    assert r.status_code == 200, r.content
    exited = {**report, "status": "exited", "exit_code": 1, "finished_at": 1.0e9 + 5,
              "log_tail": f"Traceback\nValueError: bad token {VALUE}\n"}  # fmt: skip
    assert _beat(agent, containers=[exited]).status_code == 200
    # then every stored and shown line is masked
    stored = [
        line for line in RunLogLine.objects.order_by("line_no").values_list("line", flat=True)
    ]
    assert stored == ["token=****", "****", "login **** ok"]
    assert json.dumps(list(RunMetric.objects.values_list("data", flat=True))).count("****") == 1
    rental.refresh_from_db()
    assert rental.status == "failed"
    assert rental.status_reason.endswith("ValueError: bad token ****"), rental.status_reason
    assert "****" in rental.log_tail and VALUE not in rental.log_tail
    assert VALUE not in ContainerRun.objects.get(run_id=run_id).log_tail
    owner = APIClient()
    owner.force_authenticate(user)
    shown = _every_get(owner, [f"/api/v1/rentals/{rid}/", f"/api/v1/rentals/{rid}/logs/"])
    for value in (VALUE, "line-two-of-key", "reg-p4ssword"):
        assert value not in shown


def test_rotation_reencrypts_with_the_new_first_key(auth_api, settings):
    auth_api.post("/api/v1/secrets/", {"name": "HF_TOKEN", "value": VALUE}, format="json")
    secret = TeamSecret.objects.get()
    new = Fernet.generate_key().decode()
    settings.SECRETS_ENCRYPTION_KEYS = [new, *settings.SECRETS_ENCRYPTION_KEYS]
    assert secrets_reencrypt() == 1
    settings.SECRETS_ENCRYPTION_KEYS = [new]  # the old key dropped
    assert (
        secret_values(pairs=[(secret.team_id, "HF_TOKEN")])[(secret.team_id, "HF_TOKEN")] == VALUE
    )
