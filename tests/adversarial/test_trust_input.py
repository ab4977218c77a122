"""The input defects of the trust review, each sent as it was found: every answer is a 4xx in
JSON naming what it refused, and nothing is written. Each was a 500, an HTML page, an accepted
key or path, or a dropped connection before."""

# The agent API suite's fixtures are imported below, so test arguments "redefine" them.
# ruff: noqa: F811

from __future__ import annotations

import base64
import io
import json
import struct
from wsgiref.util import setup_testing_defaults

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from accounts.models import ApiToken, SshKey, Team
from marketplace.models import Rental
from storage.models import Artifact, Dataset
from tests.provisioning.test_agent_api import _beat, _schedule, agent  # noqa: F401

pytestmark = pytest.mark.django_db

BIDI = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: "report\u202etxt.exe" shows as "reportexe.txt"


def _refused(response, status: int, field: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert field in json.dumps(body), body
    return body


# --- URLs a customer gives: one parser, every parse error a 400 naming the field ---------------


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com:99999/data.bin",  # a port past 65535
        "https://" + "a" * 64 + ".example.com/data.bin",  # a 64-character label
        "https://a..example.com/data.bin",  # an empty label
        "https://[::1/data.bin",  # an unclosed IPv6 bracket
        f"https://example.com/{BIDI}nib.exe",
    ],
)
def test_a_dataset_source_url_that_does_not_parse_is_a_400_naming_it(auth_api, url):
    r = auth_api.post("/api/v1/datasets/", {"name": "d1", "source_url": url}, format="json")
    _refused(r, 400, "source_url")
    assert not Dataset.objects.exists()


def test_a_webhook_url_that_does_not_parse_is_a_400_naming_it(auth_api):
    for url in ("https://example.com:99999/hook", "https://" + "a" * 64 + ".example.com/"):
        r = auth_api.patch("/api/v1/notifications/settings/", {"webhook_url": url}, format="json")
        _refused(r, 400, "webhook_url")
    assert auth_api.get("/api/v1/notifications/settings/").json()["webhook_url"] == ""


# --- request bodies: JSON errors, and the connection kept in step --------------------------------


def test_a_20_mb_body_is_a_json_413_and_writes_nothing(auth_api):
    big = json.dumps({"name": "x" * (20 << 20)})
    tokens = ApiToken.objects.count()  # the client's own
    for path in ("/api/v1/tokens/", "/api/v1/datasets/", "/api/v1/rentals/", "/api/v1/ssh-keys/"):
        r = auth_api.post(path, big, content_type="application/json")
        assert r.status_code == 413, (path, r.content[:200])
        assert r["Content-Type"].startswith("application/json")
        assert r.json()["code"] == "payload_too_large"
    assert (ApiToken.objects.count(), Dataset.objects.count(), Rental.objects.count()) == (
        tokens,
        0,
        0,
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/rentals/00000000-0000-0000-0000-000000000000/cancel/",  # 401: never read
        "/api/agent/v1/heartbeat/",  # 401 from the agent handler
        "/api/v1/no-such-route/",  # 404
    ],
)
def test_a_body_the_view_never_reads_is_drained_before_the_answer(path):
    """gunicorn drains at most 64 KiB of an unread body and otherwise closes the connection after
    a keep-alive answer: the client's next request on it is dropped. The whole body is read."""
    from config.wsgi import application

    raw = b'{"pad": "' + b"x" * (300 << 10) + b'"}'
    stream = io.BytesIO(raw)
    environ = {
        "REQUEST_METHOD": "POST", "PATH_INFO": path, "HTTP_HOST": "127.0.0.1",
        "REMOTE_ADDR": "127.0.0.1", "wsgi.input": stream, "CONTENT_LENGTH": str(len(raw)),
        "CONTENT_TYPE": "application/json",
    }  # fmt: skip
    setup_testing_defaults(environ)
    answer = {}

    def start_response(status, headers, exc_info=None):
        answer["status"], answer["headers"] = int(status.split()[0]), dict(headers)

    content = b"".join(application(environ, start_response))
    assert 400 <= answer["status"] < 500, content[:200]
    assert answer["headers"]["Content-Type"].startswith("application/json")
    assert stream.tell() == len(raw)


# --- SSH keys: loaded and checked by the cryptography library ------------------------------------


def _wire(*parts: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def _rsa_with_exponent(e: int) -> str:
    n = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    modulus = n.public_numbers().n
    mpint = modulus.to_bytes(modulus.bit_length() // 8 + 1, "big")
    exponent = e.to_bytes(max(1, (e.bit_length() + 7) // 8), "big")  # 0: one zero byte
    return "ssh-rsa " + base64.b64encode(_wire(b"ssh-rsa", exponent, mpint)).decode()


def _ecdsa_off_the_curve() -> str:
    good = ec.generate_private_key(ec.SECP256R1()).public_key()
    point = bytearray(good.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    ))  # fmt: skip
    point[-1] ^= 1  # y moved by one: no longer on the curve
    blob = _wire(b"ecdsa-sha2-nistp256", b"nistp256", bytes(point))
    return "ecdsa-sha2-nistp256 " + base64.b64encode(blob).decode()


@pytest.mark.parametrize(
    "key",
    [_rsa_with_exponent(0), _rsa_with_exponent(1), _rsa_with_exponent(4), _ecdsa_off_the_curve()],
    ids=["rsa-e0", "rsa-e1", "rsa-even", "ecdsa-off-curve"],
)
def test_an_ssh_key_whose_numbers_are_bad_is_a_400_and_stores_nothing(auth_api, key):
    r = auth_api.post("/api/v1/ssh-keys/", {"public_key": key}, format="json")
    _refused(r, 400, "public_key")
    assert not SshKey.objects.exists()


def test_a_good_ecdsa_key_is_still_accepted(auth_api):
    good = ec.generate_private_key(ec.SECP256R1()).public_key()
    line = good.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    r = auth_api.post("/api/v1/ssh-keys/", {"public_key": line.decode()}, format="json")
    assert r.status_code == 201, r.content


# --- bidi and other invisible characters in paths and names -------------------------------------


@pytest.mark.parametrize("char", [BIDI, "\u2066", "\u200b", "\u2028", "\ufeff"])
def test_a_dataset_file_path_with_a_bidi_or_invisible_character_is_refused(auth_api, char):
    files = [{"path": f"report{char}txt.exe", "size_bytes": 1, "sha256": "0" * 64}]
    r = auth_api.post("/api/v1/datasets/", {"name": "d1", "files": files}, format="json")
    _refused(r, 400, "path")
    assert not Dataset.objects.exists()


def test_an_artifact_path_with_a_bidi_override_is_refused(agent, rent):
    # Given a run handed to the node
    rental = _schedule(rent, 1)
    [desired] = _beat(agent).json()["desired"]
    # When its agent asks to upload `report<RLO>txt.exe` (shown as "reportexe.txt")
    r = agent.post(
        f"/api/agent/v1/rentals/{rental.pk}/artifacts/uploads/",
        {"run_id": desired["run_id"],
         "files": [{"path": f"out/report{BIDI}txt.exe", "size_bytes": 1, "sha256": "0" * 64}]},
        format="json",
    )  # fmt: skip
    # Then it is refused, naming the path, and nothing is recorded
    _refused(r, 400, "path")
    assert not Artifact.objects.exists()


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/v1/tokens/", {"name": f"ci{BIDI}cod"}, "name"),
        ("/api/v1/teams/", {"name": f"ops{BIDI}nimda"}, "name"),
        (
            "/api/v1/rentals/",
            {"name": f"run{BIDI}", "gpus_per_node": 1, "duration_s": 3600,
             "runtime": {"image": "gpumarket/harness:dev"}},
            "name",
        ),
    ],
)  # fmt: skip
def test_a_name_with_a_bidi_override_is_refused(auth_api, user, path, body, field):
    teams = Team.objects.count()
    r = auth_api.post(path, body, format="json")
    _refused(r, 400, field)
    assert (ApiToken.objects.count(), Team.objects.count(), Rental.objects.count()) == (
        ApiToken.objects.filter(user=user).count(),
        teams,
        0,
    )
    assert not ApiToken.objects.filter(name__contains=BIDI).exists()
