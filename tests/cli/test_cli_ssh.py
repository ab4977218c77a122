"""The SSH commands of the command line against the live server over real HTTP."""

import io
import subprocess
from pathlib import Path

import pytest

from accounts.models import SshKey
from marketplace.models import Rental
from tests.cli.test_cli import cli  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def _keygen(path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "me@laptop", "-f",
                    str(path)], check=True, timeout=60)  # fmt: skip
    return f"{path}.pub"


def test_keys_are_added_from_a_file_or_stdin_listed_and_removed(
    cli,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    code, out, _ = cli("ssh-key", "add", _keygen(tmp_path / "a"))
    assert code == 0, out
    first = SshKey.objects.get()
    assert out.split() == [str(first.pk), "ssh-ed25519", first.fingerprint, "me@laptop"]

    second = Path(_keygen(tmp_path / "b")).read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO(second))
    code, out, _ = cli("ssh-key", "add", "-", "--name", "desktop")
    assert code == 0 and out.split()[-1] == "desktop"

    code, out, _ = cli("ssh-key", "ls")
    assert code == 0 and first.fingerprint in out and "desktop" in out

    code, out, _ = cli("ssh-key", "rm", str(first.pk))
    assert code == 0 and not SshKey.objects.filter(pk=first.pk).exists()
    code, _, err = cli("ssh-key", "rm", str(first.pk))
    assert code == 1 and "404" in err


def test_a_malformed_key_file_is_refused_naming_the_field(cli, tmp_path):  # noqa: F811
    bad = tmp_path / "bad.pub"
    bad.write_text("ssh-ed25519 AAAAnot-base64!\n")
    code, _, err = cli("ssh-key", "add", str(bad))
    assert code == 1 and "400" in err and "public_key" in err
    code, _, err = cli("ssh-key", "add", str(tmp_path / "missing.pub"))
    assert code == 1 and "cannot read" in err
    assert SshKey.objects.count() == 0


def test_rent_with_ssh_asks_for_it(cli, make_node, tmp_path):  # noqa: F811
    make_node(card="h100-sxm5-80gb", price="2.50", hostname="fra-1")
    code, _, err = cli("rent", "--gpus", "1", "--image", "img", "--ssh")
    assert code == 1 and "ssh" in err  # no key on the account yet
    cli("ssh-key", "add", _keygen(tmp_path / "a"))
    code, _, _ = cli("rent", "--gpus", "1", "--image", "img", "--ssh")
    assert code == 0
    rental = Rental.objects.get()
    assert rental.ssh is True
    code, _, err = cli("ssh-command", str(rental.pk))
    assert code == 1 and "no SSH into" in err and "pending" in err


def test_rent_with_jupyter_and_ports_then_show_and_jupyter_name_what_is_there(
    cli,  # noqa: F811
    make_node,
):
    from provisioning.models import ContainerRun

    node = make_node(card="h100-sxm5-80gb", price="2.50", hostname="fra-1")
    code, out, err = cli("rent", "--gpus", "1", "--image", "img", "--jupyter", "--port", "8000")
    assert code == 0, err
    rental = Rental.objects.get()
    assert (rental.jupyter, rental.ports, rental.command) == (True, [8000], ["sleep", "infinity"])
    # before it runs: the ports are named as to come, and there is no notebook to tunnel to
    code, out, _ = cli("show", str(rental.pk))
    assert "ports     8000 (published once it runs)" in out
    code, _, err = cli("jupyter", str(rental.pk))
    assert code == 1 and "no JupyterLab in" in err
    # once both ports are published: each is a URL, and without SSH `jupyter` prints the URL
    Rental.objects.filter(pk=rental.pk).update(status="running")
    ContainerRun.objects.create(
        rental=rental, node=node, run_id="r1", status="running",
        published=[{"container_port": 8000, "host": "fra-1", "host_port": 41000},
                   {"container_port": 8888, "host": "fra-1", "host_port": 41001}],
    )  # fmt: skip
    code, out, _ = cli("show", str(rental.pk))
    lab = f"http://fra-1:41001/lab?token={rental.jupyter_token}"
    assert "access    http://fra-1:41000/" in out and f"access    {lab}" in out
    code, out, _ = cli("jupyter", str(rental.pk))
    assert code == 0 and out.splitlines()[0] == lab and "--ssh" in out
    # a rental without a notebook says so
    other = cli("rent", "--gpus", "1", "--image", "img")[1].split()[0]
    code, _, err = cli("jupyter", other)
    assert code == 1 and "rent with --jupyter" in err
