"""SSH public keys on the account: checked before anything is stored, scoped to their owner,
handed to the agent for the rentals that ask for SSH, and the way in shown once published."""

from __future__ import annotations

import base64
import struct
import subprocess
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from accounts.models import SshKey
from accounts.services import api_token_create
from accounts.services.sshkeys import ssh_key_add, ssh_key_parse
from core.errors import ValidationFailed
from marketplace.models import Rental
from provisioning.models import ContainerRun
from scheduler.services import scheduler_cycle_run
from tests.factories import personal_team
from tests.provisioning.test_agent_api import _beat, agent  # noqa: F401

pytestmark = pytest.mark.django_db


def _keygen(tmp_path: Path, kind: str, bits: int | None = None, comment: str = "me@laptop") -> str:
    path = tmp_path / f"{kind}-{bits}"
    args = ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", comment, "-f", str(path)]
    if bits:
        args += ["-b", str(bits)]
    subprocess.run(args, check=True, timeout=120)
    return path.with_suffix(".pub").read_text().strip()


def _fingerprint(tmp_path: Path, line: str) -> str:
    path = tmp_path / "fp.pub"
    path.write_text(line + "\n")
    out = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", str(path)],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    bits, fingerprint = out.split()[:2]
    return f"{bits} {fingerprint}"


def _blob(*parts: bytes) -> str:
    return base64.b64encode(b"".join(struct.pack(">I", len(p)) + p for p in parts)).decode()


WEAK_RSA = _blob(b"ssh-rsa", b"\x01\x00\x01", b"\x00" + b"\xff" * 128)
WRONG_CURVE = _blob(b"ecdsa-sha2-nistp256", b"nistp384", b"\x04" * 65)


@pytest.mark.parametrize(
    ("kind", "bits", "expected_bits"),
    [("ed25519", None, 256), ("rsa", 2048, 2048), ("ecdsa", 256, 256), ("ecdsa", 384, 384),
     ("ecdsa", 521, 521)],
)  # fmt: skip
def test_real_keys_parse_with_ssh_keygens_fingerprint_and_bits(tmp_path, kind, bits, expected_bits):
    line = _keygen(tmp_path, kind, bits)
    parsed = ssh_key_parse(line)
    assert parsed.bits == expected_bits
    assert _fingerprint(tmp_path, line) == f"{parsed.bits} {parsed.fingerprint}"
    assert parsed.comment == "me@laptop"
    assert parsed.line == " ".join(line.split()[:2])  # the comment is not part of it


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "paste an OpenSSH public key"),
        ("ssh-ed25519", "no body"),
        ("ssh-ed25519 not*base64", "not valid base64"),
        ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA", "not valid base64"),  # cut short
        (f"ssh-ed25519 {_blob(b'ssh-ed25519', b'x' * 31)}", "32 bytes"),
        (f"ssh-ed25519 {_blob(b'ssh-rsa', b'x' * 32)}", "not an ssh-ed25519 key"),
        (f"ssh-ed25519 {_blob(b'ssh-ed25519', b'x' * 32, b'extra')}", "bytes after the key"),
        (f"ssh-rsa {WEAK_RSA}", "too weak"),
        (f"ssh-dss {_blob(b'ssh-dss', b'x')}", "DSA keys are refused"),
        (f'command="sh" ssh-ed25519 {_blob(b"ssh-ed25519", b"x" * 32)}', "unknown key type"),
        (f"ssh-ed25519 {_blob(b'ssh-ed25519', b'x' * 32)} a\nssh-ed25519 AAAA", "several lines"),
        ("-----BEGIN OPENSSH PRIVATE KEY----- b3BlbnNzaC1rZXktdjE=", "private key"),
        (f"ecdsa-sha2-nistp256 {WRONG_CURVE}", "curve is not nistp256"),
    ],
)  # fmt: skip
def test_malformed_keys_are_refused_naming_the_field(text, why):
    with pytest.raises(ValidationFailed, match=why) as refused:
        ssh_key_parse(text)
    assert refused.value.field == "public_key"


def test_keys_are_added_listed_and_deleted_through_the_api(auth_api, user, tmp_path):
    line = _keygen(tmp_path, "ed25519")
    r = auth_api.post("/api/v1/ssh-keys/", {"public_key": line + "\n"}, format="json")
    assert r.status_code == 201, r.content
    created = r.json()
    assert created["name"] == "me@laptop"
    assert created["key_type"] == "ssh-ed25519" and created["bits"] == 256
    assert f"256 {created['fingerprint']}" == _fingerprint(tmp_path, line)
    assert [k["id"] for k in auth_api.get("/api/v1/ssh-keys/").json()] == [created["id"]]

    # the same key again is refused, and nothing more is stored
    again = auth_api.post("/api/v1/ssh-keys/", {"public_key": line, "name": "x"}, format="json")
    assert again.status_code == 400
    assert "already on your team" in again.json()["public_key"][0]
    assert SshKey.objects.count() == 1

    assert auth_api.delete(f"/api/v1/ssh-keys/{created['id']}/").status_code == 204
    assert auth_api.get("/api/v1/ssh-keys/").json() == []


def test_a_malformed_key_is_a_400_naming_the_field_and_stores_nothing(auth_api):
    for body in (
        {"public_key": "ssh-ed25519 AAAA!!"},
        {"public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB"},
        {"public_key": 42},
        {"public_key": "x" * 20000},
        {"public_key": "ssh-ed25519 AAAA", "owner": 1},
        {},
    ):
        r = auth_api.post("/api/v1/ssh-keys/", body, format="json")
        assert r.status_code == 400, (body, r.content)
        assert set(r.json()) & {"public_key", "owner"}, r.json()
    assert SshKey.objects.count() == 0


def test_another_accounts_key_is_404_and_not_listed(auth_api, tmp_path):
    other = get_user_model().objects.create_user("other", "other@example.com", "pw")
    theirs = ssh_key_add(
        team=personal_team(other), owner=other, public_key=_keygen(tmp_path, "ed25519")
    )
    assert auth_api.get("/api/v1/ssh-keys/").json() == []
    assert auth_api.delete(f"/api/v1/ssh-keys/{theirs.pk}/").status_code == 404
    assert auth_api.delete("/api/v1/ssh-keys/999999/").status_code == 404
    assert SshKey.objects.filter(pk=theirs.pk).exists()


def test_a_rental_asking_for_ssh_without_a_key_is_refused_and_not_stored(auth_api):
    body = {
        "gpus_per_node": 1, "duration_s": 3600, "ssh": True,
        "runtime": {"image": "gpumarket/harness:dev"},
    }  # fmt: skip
    r = auth_api.post("/api/v1/rentals/", body, format="json")
    assert r.status_code == 400
    assert "SSH public key" in r.json()["ssh"][0]
    assert Rental.objects.count() == 0


def test_the_agent_gets_the_keys_and_port_22_and_the_published_port_is_shown(
    agent,  # noqa: F811
    rent,
    user,
    tmp_path,
):
    # given a customer with two keys (and another account with one) and a rental with SSH
    mine = [_keygen(tmp_path, "ed25519"), _keygen(tmp_path, "rsa", 3072)]
    for line in mine:
        ssh_key_add(team=personal_team(user), owner=user, public_key=line)
    other = get_user_model().objects.create_user("other", "other@example.com", "pw")
    ssh_key_add(team=personal_team(other), owner=other, public_key=_keygen(tmp_path, "ecdsa", 256))
    rental = rent(1, ssh=True)
    scheduler_cycle_run()

    # when the node asks what to run: the customer's keys (without comments) and port 22
    [desired] = _beat(agent).json()["desired"]
    assert desired["ports"] == [22]
    assert desired["ssh_authorized_keys"] == [" ".join(line.split()[:2]) for line in mine]

    # when the agent reports the port published (and one the rental did not ask for)
    report = {
        "rental_id": str(rental.pk), "run_id": desired["run_id"], "status": "running",
        "started_at": 1.0e9,
        "published": [
            {"container_port": 22, "host": "gpu-host-1.example", "host_port": 42022},
            {"container_port": 8888, "host": "gpu-host-1.example", "host_port": 42888},
        ],
    }  # fmt: skip
    assert _beat(agent, containers=[report]).status_code == 200
    owner = APIClient()
    owner.force_authenticate(user)
    shown = owner.get(f"/api/v1/rentals/{rental.pk}/").json()
    assert shown["ssh"] is True
    assert shown["access"] == [
        {"container_port": 22, "host": "gpu-host-1.example", "host_port": 42022,
         "command": "ssh -p 42022 harness@gpu-host-1.example", "url": ""},
    ]  # fmt: skip

    # when the run exits, nothing is reachable any more
    exited = {**report, "status": "exited", "exit_code": 0, "finished_at": 1.0e9 + 5}
    _beat(agent, containers=[exited])
    assert ContainerRun.objects.get(run_id=desired["run_id"]).published == []
    assert owner.get(f"/api/v1/rentals/{rental.pk}/").json()["access"] == []


def test_a_key_one_member_added_opens_the_rentals_another_member_creates_in_that_team_only(
    agent,  # noqa: F811
    rent,
    user,
    tmp_path,
):
    from accounts.services import team_create
    from tests.accounts.test_teams import _join

    # Given a team whose member A added a key through the API (listed with who added it)
    acme = team_create(owner=user, name="acme")
    colleague = get_user_model().objects.create_user("b", "b@example.com", "pw")
    _join(acme, user, colleague)
    _, raw = api_token_create(user=user, team=acme, name="t")
    as_a = APIClient()
    as_a.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    line = _keygen(tmp_path, "ed25519")
    added = as_a.post("/api/v1/ssh-keys/", {"public_key": line}, format="json")
    assert added.status_code == 201 and added.json()["added_by"] == user.username
    # And a key in another team (A's personal one)
    other_line = _keygen(tmp_path, "ecdsa", 256)
    ssh_key_add(team=personal_team(user), owner=user, public_key=other_line)
    # When member B rents with SSH for the team
    rental = rent(1, customer=colleague, team=acme, ssh=True)
    scheduler_cycle_run()
    # Then the node lets A's team key in, and not the other team's
    [desired] = [d for d in _beat(agent).json()["desired"] if d["rental_id"] == str(rental.pk)]
    assert desired["ssh_authorized_keys"] == [" ".join(line.split()[:2])]
    # And B lists and removes the key A added; another team's key id is 404 for B
    _, raw_b = api_token_create(user=colleague, team=acme, name="t")
    as_b = APIClient()
    as_b.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_b}")
    [listed] = as_b.get("/api/v1/ssh-keys/").json()
    assert listed["id"] == added.json()["id"] and listed["added_by"] == user.username
    [theirs] = SshKey.objects.exclude(team=acme)
    assert as_b.delete(f"/api/v1/ssh-keys/{theirs.pk}/").status_code == 404
    assert as_b.delete(f"/api/v1/ssh-keys/{listed['id']}/").status_code == 204
    assert list(SshKey.objects.values_list("pk", flat=True)) == [theirs.pk]


def test_a_member_of_a_team_without_keys_is_refused_ssh_even_with_keys_elsewhere(
    rent, user, tmp_path
):
    from accounts.services import team_create

    ssh_key_add(team=personal_team(user), owner=user, public_key=_keygen(tmp_path, "ed25519"))
    acme = team_create(owner=user, name="acme")
    with pytest.raises(ValidationFailed) as refused:
        rent(1, team=acme, ssh=True)
    assert refused.value.field == "ssh"
    assert not Rental.objects.filter(team=acme).exists()


def test_a_bad_published_port_drops_only_that_report(agent, rent, user, tmp_path):  # noqa: F811
    ssh_key_add(team=personal_team(user), owner=user, public_key=_keygen(tmp_path, "ed25519"))
    rental = rent(1, ssh=True)
    scheduler_cycle_run()
    [desired] = _beat(agent).json()["desired"]
    report = {
        "rental_id": str(rental.pk), "run_id": desired["run_id"], "status": "running",
        "started_at": 1.0e9,
        "published": [{"container_port": 22, "host": "a b;rm", "host_port": 70000}],
    }  # fmt: skip
    answer = _beat(agent, containers=[report])
    assert answer.status_code == 200
    assert answer.json()["dropped"] == {"containers": 1}
    assert ContainerRun.objects.get(run_id=desired["run_id"]).published == []


def test_the_keys_page_lists_only_the_accounts_keys(client, user, tmp_path):
    mine = ssh_key_add(
        team=personal_team(user), owner=user, public_key=_keygen(tmp_path, "ed25519")
    )
    other = get_user_model().objects.create_user("other", "other@example.com", "pw")
    theirs = ssh_key_add(
        team=personal_team(other), owner=other, public_key=_keygen(tmp_path, "ecdsa", 256)
    )
    client.force_login(user)
    page = client.get("/ssh-keys/").content.decode()
    assert mine.fingerprint in page and theirs.fingerprint not in page
    assert f'data-url="/api/v1/ssh-keys/{mine.pk}/"' in page


def test_the_rental_page_shows_the_ssh_command(
    client,
    agent,  # noqa: F811
    rent,
    user,
    tmp_path,
):
    ssh_key_add(team=personal_team(user), owner=user, public_key=_keygen(tmp_path, "ed25519"))
    rental = rent(1, ssh=True)
    scheduler_cycle_run()
    [desired] = _beat(agent).json()["desired"]
    client.force_login(user)
    assert (
        "once the container's sshd listens" in client.get(f"/rentals/{rental.pk}/").content.decode()
    )
    report = {
        "rental_id": str(rental.pk), "run_id": desired["run_id"], "status": "running",
        "started_at": 1.0e9,
        "published": [{"container_port": 22, "host": "gpu-host-1.example", "host_port": 42022}],
    }  # fmt: skip
    _beat(agent, containers=[report])
    page = client.get(f"/rentals/{rental.pk}/").content.decode()
    assert '<code class="ssh-command">ssh -p 42022 harness@gpu-host-1.example</code>' in page
