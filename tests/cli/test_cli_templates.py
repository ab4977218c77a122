"""`gpumarket template` and `rent --template` against the live server over real HTTP."""

import json

import pytest

from marketplace.models import Rental, RentalTemplate
from tests.cli.test_cli import cli  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_template_saved_listed_used_replaced_and_removed(cli, make_node, tmp_path):  # noqa: F811
    make_node(card="a100-sxm4-80gb")
    config = tmp_path / "harness.json"
    config.write_text(json.dumps({"model": {"name": "gpt"}, "data": {"name": "text"}}))
    code, out, err = cli(
        "template", "save", "gpt-text", "--image", "gpumarket/harness:dev",
        "--env", "WANDB_MODE=offline", "--port", "8888", "--harness-config", str(config),
        "--description", "GPT on the bundled text",
    )  # fmt: skip
    assert (code, out.strip()) == (0, "saved gpt-text"), err
    code, out, _ = cli("template", "ls")
    assert code == 0 and "gpt-text" in out and "GPT on the bundled text" in out
    code, out, _ = cli("template", "show", "gpt-text")
    assert "env      WANDB_MODE=offline" in out and "ports    8888" in out
    assert '"model": {"name": "gpt"}' in out

    code, out, err = cli(
        "rent", "--gpus", "1", "--hours", "1", "--template", "gpt-text", "--env", "SEED=3"
    )
    assert code == 0 and out.split()[1] == "pending", err
    rental = Rental.objects.get()
    assert rental.image == "gpumarket/harness:dev" and rental.ports == [8888]
    assert rental.env == {"WANDB_MODE": "offline", "SEED": "3"}
    assert rental.harness_config == {"model": {"name": "gpt"}, "data": {"name": "text"}}

    # Saved again under the same name: refused unless asked to replace
    code, _, err = cli("template", "save", "gpt-text", "--image", "other:1")
    assert code == 1 and "name" in err
    code, out, _ = cli(
        "template", "save", "gpt-text", "--image", "other:1", "--replace", "--", "run"
    )
    assert code == 0 and RentalTemplate.objects.get().image == "other:1"
    assert RentalTemplate.objects.get().command == ["run"]
    code, out, _ = cli("template", "rm", "gpt-text")
    assert (code, out.strip()) == (0, "removed gpt-text")
    code, _, err = cli("rent", "--gpus", "1", "--template", "gpt-text")
    assert code == 1 and "template" in err and Rental.objects.count() == 1


def test_a_template_keeps_the_network_and_rent_may_override_it(cli, make_node):  # noqa: F811
    make_node(card="a100-sxm4-80gb")
    code, _, err = cli("template", "save", "offline", "--image", "img", "--network", "internal")
    assert code == 0, err
    code, out, _ = cli("template", "show", "offline")
    assert "network  internal" in out.splitlines()
    assert cli("rent", "--gpus", "1", "--template", "offline")[0] == 0
    assert cli("rent", "--gpus", "1", "--template", "offline", "--network", "internet")[0] == 0
    networks = list(Rental.objects.order_by("created_at").values_list("network", flat=True))
    assert networks == ["internal", "internet"]


def test_rent_needs_an_image_or_a_template_and_good_flags(cli):  # noqa: F811
    code, _, err = cli("rent", "--gpus", "1")
    assert code == 1 and "--image" in err
    code, _, err = cli("rent", "--gpus", "1", "--image", "img", "--env", "NOEQUALS")
    assert code == 1 and "NAME=VALUE" in err
    assert not Rental.objects.exists()


def test_rent_books_ahead_with_start_at_and_names_a_bad_time(cli, make_node):  # noqa: F811
    from datetime import UTC, datetime, timedelta

    make_node(card="a100-sxm4-80gb")
    when = (datetime.now(UTC) + timedelta(hours=30)).replace(microsecond=0)
    code, _, err = cli(
        "rent", "--gpus", "1", "--image", "img", "--start-at", when.strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    assert code == 0, err
    assert Rental.objects.get().start_at == when
    code, _, err = cli("rent", "--gpus", "1", "--image", "img", "--start-at", "next tuesday")
    assert code == 1 and "start_at" in err
    assert Rental.objects.count() == 1
