"""`gpumarket secret` and `rent --secret` against the live server over real HTTP."""

import io

import pytest

from accounts.models import TeamSecret
from accounts.services.secrets import secret_values
from marketplace.models import Rental
from tests.cli.test_cli import cli  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_secret_set_from_a_file_and_stdin_listed_used_and_removed(
    cli,  # noqa: F811
    make_node,
    tmp_path,
    monkeypatch,
):
    make_node(card="a100-sxm4-80gb")
    token = tmp_path / "token.txt"
    token.write_text("hf_from_a_file_0123\n")
    code, out, err = cli("secret", "set", "HF_TOKEN", "--from-file", str(token))
    assert (code, out.strip()) == (0, "set HF_TOKEN"), err
    monkeypatch.setattr("sys.stdin", io.StringIO("me:piped-password\n"))
    code, out, err = cli("secret", "set", "REG")
    assert (code, out.strip()) == (0, "set REG"), err
    team_id = TeamSecret.objects.get(name="REG").team_id
    assert secret_values(pairs=[(team_id, "HF_TOKEN"), (team_id, "REG")]) == {
        (team_id, "HF_TOKEN"): "hf_from_a_file_0123\n",
        (team_id, "REG"): "me:piped-password",
    }
    code, out, _ = cli("secret", "ls")
    assert code == 0 and "HF_TOKEN" in out and "REG" in out
    assert "hf_from_a_file" not in out and "piped-password" not in out

    code, out, err = cli(
        "rent", "--gpus", "1", "--hours", "1", "--image", "registry.example/me/img:1",
        "--secret", "HF_TOKEN", "--secret", "REG=file", "--registry-secret", "REG",
    )  # fmt: skip
    assert code == 0, err
    rental = Rental.objects.get()
    assert rental.secrets == [
        {"name": "HF_TOKEN", "env": "HF_TOKEN", "file": ""},
        {"name": "REG", "env": "", "file": "/run/secrets/REG"},
    ]
    assert rental.registry_secret == "REG"
    code, out, _ = cli("show", str(rental.pk))
    assert "secrets   HF_TOKEN, REG" in out and "piped-password" not in out

    code, _, err = cli("rent", "--gpus", "1", "--image", "img", "--secret", "NOPE")
    assert code == 1 and "secrets" in err and Rental.objects.count() == 1
    code, out, _ = cli("secret", "rm", "HF_TOKEN")
    assert (code, out.strip()) == (0, "removed HF_TOKEN")
    code, _, err = cli("secret", "rm", "HF_TOKEN")
    assert code == 1 and "no such secret" in err
    assert list(TeamSecret.objects.values_list("name", flat=True)) == ["REG"]
