"""The command line against the live server over real HTTP."""

import pytest

from marketplace.cli import main
from marketplace.models import Rental
from marketplace.services import api_token_create

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli(live_server, user, capsys):
    _, token = api_token_create(user=user, name="cli")

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--server", live_server.url, "--token", token, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_offers_advise_rent_show_and_cancel(cli, make_node):
    make_node(card="h100-sxm5-80gb", price="2.50", nvlink=True, hostname="fra-1")
    code, out, _ = cli("offers", "--gpu-family", "h100")
    assert code == 0 and "fra-1" in out and "H100 SXM5 80 GB" in out
    code, out, _ = cli("advise", "--model", "llama2-7b", "--tokens-b", "1")
    assert code == 0 and "h100-sxm5-80gb:1x" in out and "cheapest" in out
    code, out, _ = cli("rent", "--gpus", "2", "--hours", "2", "--image", "img", "--", "train")
    assert code == 0 and out.split()[1] == "pending"
    rental = Rental.objects.get()
    assert (rental.gpus_per_node, rental.duration_s, rental.command) == (2, 7200, ["train"])
    code, out, _ = cli("rentals")
    assert str(rental.pk) in out
    code, out, _ = cli("cancel", str(rental.pk))
    assert code == 0 and out.split()[1] == "cancelled"


def test_errors_are_shown_with_the_field_and_a_non_zero_exit(cli):
    code, _, err = cli("rent", "--gpus", "0", "--image", "img")
    assert code == 1 and "gpus_per_node" in err
    code, _, err = cli("show", "00000000-0000-0000-0000-000000000000")
    assert code == 1 and "404" in err


def test_a_provider_lists_prices_drains_and_joins_hosts(live_server, provider, make_node, capsys):
    from django.utils import timezone

    from marketplace.models import Node, NodeStatus
    from provisioning.models import JoinToken

    _, token = api_token_create(user=provider.owner, name="cli")

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main(["--server", live_server.url, "--token", token, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    node = make_node(hostname="ams-7", price="1.00", min_bid="0.40")
    Node.objects.filter(pk=node.pk).update(last_seen_at=timezone.now())  # its agent heartbeats
    code, out, _ = cli("nodes")
    assert code == 0 and "ams-7" in out and "online" in out
    code, out, _ = cli("price", str(node.pk), "--price", "1.10")
    assert code == 0 and out.split() == ["ams-7", "1.1000", "0.4000"]
    code, _, err = cli("price", str(node.pk), "--min-bid", "9")
    assert code == 1 and "min_bid_per_gpu_hour" in err
    code, out, _ = cli("drain", str(node.pk))
    assert code == 0 and out.split() == ["ams-7", "draining"]
    assert Node.objects.get(pk=node.pk).status == NodeStatus.DRAINING
    code, out, _ = cli("relist", str(node.pk))
    assert code == 0 and out.split() == ["ams-7", "online"]
    code, out, _ = cli("earnings")
    assert code == 0 and provider.name in out
    code, out, _ = cli(
        "join-token", "--provider", provider.name, "--region", "eu", "--price", "2",
        "--min-bid", "1",
    )  # fmt: skip
    assert code == 0 and out.startswith(f"gpumarket-agent --server {live_server.url}")
    assert JoinToken.objects.filter(provider=provider, region="eu").count() == 1


def test_balance_shows_the_customers_money(cli, user):
    from billing.services.ledger import account_adjust, account_for_customer

    account_adjust(
        account_id=account_for_customer(user=user).pk,
        amount_micros=7_500_000,
        reason="credit",
        actor=None,
    )
    code, out, _ = cli("balance")
    assert code == 0 and "balance $7.50" in out and "available $7.50" in out


def test_budget_shows_and_sets_limits_and_rent_takes_a_max_cost(cli, user, make_node):
    from billing.models import FundsHold

    code, out, _ = cli("budget")
    assert code == 0 and "monthly budget      none" in out
    code, out, _ = cli("budget", "--monthly", "120.50", "--max-gpus", "4")
    assert code == 0
    assert "monthly budget      $120.50 (warn at 80 %)" in out
    assert "GPUs at once        0 of 4" in out
    code, _, err = cli("budget", "--max-rentals-per-minute", "-3")
    assert code == 1 and "400" in err and "max_rentals_per_minute" in err
    code, out, _ = cli("budget", "--monthly", "none")
    assert code == 0 and "monthly budget      none" in out
    make_node(price="1.00")
    code, out, _ = cli("rent", "--gpus", "1", "--hours", "2", "--max-cost", "1.50", "--image", "i")
    assert code == 0
    assert FundsHold.objects.get().max_charge_micros == 1_500_000
    code, _, err = cli("rent", "--gpus", "1", "--max-cost", "abc", "--image", "i")
    assert code == 1 and "max_charge" in err
