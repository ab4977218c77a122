"""The command line against the live server over real HTTP."""

import json
import re
import time

import pytest

from accounts.services import api_token_create
from gpumarket_cli.main import main
from marketplace.models import Rental
from tests.factories import personal_team
from tests.provisioning.test_agent_api import _beat, agent  # noqa: F401
from tests.provisioning.test_run_logs import _running

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli(live_server, user, capsys):
    _, token = api_token_create(user=user, team=personal_team(user), name="cli")

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--server", live_server.url, "--token", token, *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_offers_advise_rent_show_and_cancel(cli, make_node):
    code, out, _ = cli("offers")
    assert (code, out.strip()) == (0, "no free GPUs match")
    make_node(card="h100-sxm5-80gb", price="2.50", nvlink=True, hostname="fra-1")
    code, out, _ = cli("offers", "--gpu-family", "h100")
    assert code == 0 and "fra-1" in out and "H100 SXM5 80 GB" in out
    code, out, _ = cli("advise", "--model", "llama2-7b", "--tokens-b", "1")
    assert code == 0 and "h100-sxm5-80gb:1x" in out and "cheapest" in out
    # A person's table: memory per GPU in all, a duration, MFU in percent; no raw JSON parts
    header, first = out.splitlines()[:2]
    assert header.split()[:5] == ["ID", "GPUS", "GB_PER_GPU", "TIME", "MFU"]
    assert "{" not in out and re.search(r"\d+(\.\d)? (s|min|h|d) +\d+%", first), first
    # Beside the estimate, what booking it books and holds, never rounded to nothing
    assert header.split()[5:8] == ["COST", "BOOKED", "HELD"]
    assert re.search(r" \$\d+\.\d\d +\d+(\.\d)? (min|h|d) +\$\d+(\.\d+)? ", first), first
    code, out, _ = cli(
        "rent", "--gpus", "2", "--hours", "2", "--image", "img", "--name", "sweep 3", "--", "train"
    )
    assert code == 0 and out.split()[1] == "pending"
    rental = Rental.objects.get()
    assert (rental.gpus_per_node, rental.duration_s, rental.command) == (2, 7200, ["train"])
    assert rental.name == "sweep 3"
    code, out, _ = cli("show", str(rental.pk))
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"{rental.pk}  sweep 3"
    assert lines[1].split()[:2] == ["status", "pending:"]
    assert "2 per node x 1, on_demand" in lines[2] and lines[4] == "image     img train"
    assert "events" in lines and "created" in out
    code, out, _ = cli("--json", "show", str(rental.pk))
    assert json.loads(out)["id"] == str(rental.pk)
    code, _, err = cli("rent", "--gpus", "1", "--image", "img", "--name", "x" * 81)
    assert code == 1 and "name" in err and Rental.objects.count() == 1
    code, out, _ = cli("rentals")
    assert str(rental.pk) in out
    code, out, _ = cli("cancel", str(rental.pk))
    assert code == 0 and out.split()[1] == "cancelled"


def test_rent_asks_for_the_network_and_show_says_it(cli, make_node):
    make_node(card="h100-sxm5-80gb", price="2.50")
    code, out, _ = cli("rent", "--gpus", "1", "--image", "img")
    assert code == 0
    internet = Rental.objects.get()
    code, out, _ = cli("rent", "--gpus", "1", "--image", "img", "--network", "internal")
    assert code == 0
    internal = Rental.objects.exclude(pk=internet.pk).get()
    assert (internet.network, internal.network) == ("internet", "internal")
    code, out, _ = cli("show", str(internal.pk))
    assert code == 0 and "network   internal (no network)" in out.splitlines()
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cli("rent", "--gpus", "1", "--image", "img", "--network", "egress")
    assert Rental.objects.count() == 2


def test_errors_are_shown_with_the_field_and_a_non_zero_exit(cli):
    code, _, err = cli("rent", "--gpus", "0", "--image", "img")
    assert code == 1 and "gpus_per_node" in err
    code, _, err = cli("show", "00000000-0000-0000-0000-000000000000")
    assert code == 1 and "404" in err


def test_a_provider_lists_prices_drains_and_joins_hosts(live_server, provider, make_node, capsys):
    from django.utils import timezone

    from marketplace.models import Node, NodeStatus
    from provisioning.models import JoinToken

    _, token = api_token_create(
        user=provider.owner,
        team=personal_team(provider.owner),
        name="cli",
    )

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
    from billing.services.ledger import account_adjust, account_for_team

    account_adjust(
        account_id=account_for_team(team=personal_team(user)).pk,
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


def test_logs_prints_a_rentals_output_and_follows_it_to_the_end(cli, agent, rent):  # noqa: F811
    import threading

    from marketplace.lifecycle import rental_stop

    rental, run = _running(agent, rent)
    ids = {k: run[k] for k in ("rental_id", "run_id")}
    _beat(agent, logs=[{**ids, "line_no": n, "line": f"epoch {n}"} for n in range(3)])
    code, out, _ = cli("logs", str(rental.pk))
    assert code == 0 and out.splitlines() == ["epoch 0", "epoch 1", "epoch 2"]
    code, out, _ = cli("logs", "--tail", "1", str(rental.pk))
    assert out.splitlines() == ["epoch 2"]

    # Following: lines that arrive later are printed as they come, until the rental has ended.
    result = {}
    follower = threading.Thread(
        target=lambda: result.update(code=cli("logs", "-f", "--interval", "0.1", str(rental.pk)))
    )
    follower.start()
    _beat(agent, logs=[{**ids, "line_no": n, "line": f"epoch {n}"} for n in range(3, 6)])
    rental_stop(team=rental.team, actor=rental.customer, rental_id=rental.pk)
    exited = {**run, "status": "exited", "exit_code": 0, "finished_at": time.time()}
    _beat(agent, containers=[exited], logs=[{**ids, "line_no": 6, "line": "saved"}])
    follower.join(60)
    assert not follower.is_alive()
    code, out, _ = result["code"]
    assert code == 0 and out.splitlines() == [*(f"epoch {n}" for n in range(6)), "saved"]


def test_logs_of_a_run_that_failed_before_forwarding_a_line_show_its_output(cli, agent, rent):  # noqa: F811
    from marketplace.models import RentalStatus

    # Given a run that exits with an error before its agent forwarded any live line: its
    # output reaches the server only as the log tail of the exited container
    rental, run = _running(agent, rent)
    failed = {
        **run, "status": "exited", "exit_code": 1, "finished_at": time.time(),
        "log_tail": "loading data\nTraceback (most recent call last):\nValueError: boom\n",
    }  # fmt: skip
    _beat(agent, containers=[failed])
    rental.refresh_from_db()
    assert rental.status == RentalStatus.FAILED

    # When its logs are asked for, then they are that output, as `show` has its last lines
    lines = ["loading data", "Traceback (most recent call last):", "ValueError: boom"]
    code, out, _ = cli("logs", str(rental.pk))
    assert (code, out.splitlines()) == (0, lines)
    code, out, _ = cli("show", str(rental.pk))
    assert out.splitlines()[-3:] == [f"  {line}" for line in lines]
    code, out, _ = cli("logs", str(rental.pk), "--tail", "1")
    assert out.splitlines() == ["ValueError: boom"]
    code, out, _ = cli("logs", str(rental.pk), "--json")
    rows = [json.loads(text) for text in out.splitlines()]
    assert [(r["id"], r["run_id"], r["line_no"], r["line"]) for r in rows] == [
        (n + 1, run["run_id"], n, line) for n, line in enumerate(lines)
    ]
    # Following an ended rental prints the same and returns
    code, out, _ = cli("logs", "-f", "--interval", "0.1", str(rental.pk))
    assert (code, out.splitlines()) == (0, lines)


def test_logs_of_a_rental_still_running_without_lines_are_empty(cli, agent, rent):  # noqa: F811
    rental, _ = _running(agent, rent)
    code, out, _ = cli("logs", str(rental.pk))
    assert (code, out) == (0, "")


def test_every_command_prints_the_servers_answer_as_json(cli, make_node, agent, rent):  # noqa: F811
    make_node(card="h100-sxm5-80gb", price="2.50", hostname="fra-1")
    code, out, _ = cli("--json", "offers", "--gpu-family", "h100")
    offers = json.loads(out)
    assert code == 0 and offers["results"][0]["hostname"] == "fra-1"
    code, out, _ = cli(
        "--json", "rent", "--gpus", "1", "--gpu-family", "h100", "--image", "img", "--", "train"
    )
    created = json.loads(out)
    assert created["status"] == "pending" and created["command"] == ["train"]
    code, out, _ = cli("rentals", "--json")
    assert created["id"] in {r["id"] for r in json.loads(out)["results"]}
    code, out, _ = cli("--json", "balance")
    assert "balance_micros" in json.loads(out)
    rental, run = _running(agent, rent)
    ids = {k: run[k] for k in ("rental_id", "run_id")}
    _beat(agent, logs=[{**ids, "line_no": 0, "line": "hello"}])
    code, out, _ = cli("logs", str(rental.pk), "--json")
    [line] = [json.loads(text) for text in out.splitlines()]
    assert (line["line"], line["line_no"], line["run_id"]) == ("hello", 0, run["run_id"])
    # Errors stay on stderr with a non-zero exit, --json or not.
    code, out, err = cli("--json", "show", "00000000-0000-0000-0000-000000000000")
    assert code == 1 and out == "" and "404" in err


@pytest.mark.parametrize(
    ("hours", "text"),
    [(0.0001, "0 s"), (0.01, "36 s"), (0.1, "6.0 min"), (0.5, "30 min"), (3.25, "3.2 h"),
     (30, "1.2 d"), (2400, "100 d")],
)  # fmt: skip
def test_a_plans_time_reads_as_a_duration(hours, text):
    from gpumarket_cli.output import duration

    assert duration(hours) == text


def test_a_tables_floats_have_four_significant_digits_and_an_empty_one_its_header():
    from gpumarket_cli.output import table

    rows = [{"step": 10, "loss": 4.572563171386719, "mfu": 0.0008537377754423434, "note": None}]
    header, row = table(rows, ["step", "loss", "mfu", "note"]).splitlines()
    assert header.split() == ["STEP", "LOSS", "MFU", "NOTE"]
    assert row.split() == ["10", "4.573", "0.0008537"]
    assert table([], ["step", "loss"]) == "STEP  LOSS"


def test_show_summarises_a_finished_rental():
    from gpumarket_cli.rentals import rental_summary

    rental = {
        "id": "c1035768-842c-4909-8d69-194d4eafe81c", "name": "advisor: RTX 4090",
        "status": "completed", "status_reason": "finished", "exit_code": 0, "kind": "on_demand",
        "gpus_per_node": 2, "node_count": 1, "price_per_gpu_hour": "0.5000",
        "max_price_per_gpu_hour": None, "image": "gpumarket/harness:dev", "command": [],
        "scheduled_start": "2026-12-06T03:10:39.112456Z",
        "scheduled_end": "2026-12-06T03:20:39.112456Z",
        "started_at": "2026-12-06T03:10:40.495150Z", "ended_at": "2026-12-06T03:13:28.000000Z",
        # placed twice on the same node (requeued), both placements ended
        "allocations": [{"node": "local-sim-01", "gpu_index": i, "released_at": "2026-12-06"}
                        for i in (0, 1, 0, 1)],
        "datasets": ["shakespeare"], "network": "internet",
        "access": [{"command": "ssh -p 2222 root@gpu.example", "host": "gpu.example",
                    "host_port": 2222}],
        "events": [{"created_at": "2026-12-06T03:10:39.066007Z", "to_status": "pending",
                    "reason": "created"}],
        "log_tail": "".join(f"line {i}\n" for i in range(20)),
    }  # fmt: skip
    out = rental_summary(rental)
    assert "status    completed: finished (exit code 0)" in out
    assert "gpus      2 per node x 1, on_demand at $0.5000/GPU-hour" in out
    assert "on        local-sim-01 GPU 0,1" in out
    assert "booked    2026-12-06 03:10:39 to 03:20:39 (10 min)" in out
    assert "ran       2026-12-06 03:10:40 to 03:13:28 (2.8 min)" in out
    assert "datasets  shakespeare" in out and "access    ssh -p 2222 root@gpu.example" in out
    assert "network   internet (public addresses only)" in out
    assert "  2026-12-06 03:10:39  pending      created" in out
    assert out.splitlines()[-1] == "  line 19" and "line 14" not in out


def test_show_lists_each_member_of_a_multi_node_rental():
    from gpumarket_cli.rentals import rental_summary

    rental = {
        "id": "c1035768-842c-4909-8d69-194d4eafe81c", "name": "", "status": "running",
        "status_reason": "container running on gang-b", "exit_code": None, "kind": "on_demand",
        "gpus_per_node": 2, "node_count": 2, "price_per_gpu_hour": "0.5000",
        "max_price_per_gpu_hour": None, "image": "img", "command": ["train"],
        "scheduled_start": None, "scheduled_end": None, "started_at": None, "ended_at": None,
        "allocations": [], "events": [], "log_tail": "",
        "members": [
            {"node_rank": 0, "node": "gang-a", "state": "running", "exit_code": None,
             "log_tail": "step 10\nstep 11\n"},
            {"node_rank": 1, "node": "gang-b", "state": "exited", "exit_code": 1,
             "log_tail": "rank 3 failed\n"},
        ],
    }  # fmt: skip
    lines = rental_summary(rental).splitlines()
    at = lines.index("members")
    assert lines[at + 1 :] == [
        "  node 0  gang-a               running",
        "    step 10",
        "    step 11",
        "  node 1  gang-b               exited (exit code 1)",
        "    rank 3 failed",
    ]


def test_book_runs_the_plan_on_the_named_dataset(cli, user, make_node):
    from storage.models import Dataset, DatasetStatus

    # Given a card free and a ready dataset of the team's token files
    make_node(card="rtx4090-24gb", gpus=2, price="0.40")
    Dataset.objects.create(
        team=personal_team(user), owner=user, name="corpus", status=DatasetStatus.READY
    )
    # When the card's cheapest plan is booked from the command line with the dataset
    code, out, _ = cli(
        "book", "--model", "gpt2-124m", "--tokens-b", "0.1", "--card", "rtx4090-24gb",
        "--dataset", "corpus",
    )  # fmt: skip
    # Then the rental runs the planned preset on that dataset, in the planned layout
    assert code == 0, out
    rental = Rental.objects.get()
    config = rental.harness_config
    assert config["model"] == {"name": "transformer", "preset": "gpt2-124m"}
    assert config["data"]["path"] == "corpus"
    layout = config["layout"]
    assert layout["dp"] * layout["tp"] * layout["pp"] == rental.gpus_per_node * rental.node_count
    assert rental.advisor_estimate["layout"]["dp"] == layout["dp"]


def test_offers_show_the_interconnect_of_clustered_nodes(cli, make_node):
    make_node(card="h100-sxm5-80gb", price="2.50", hostname="ib-host")
    make_node(card="h100-sxm5-80gb", price="2.60", hostname="lone-host", cluster=None)
    code, out, _ = cli("offers")
    assert code == 0, out
    lines = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert lines["ib-host"].rstrip().endswith("infiniband 200 Gb/s x 1")
    assert lines["lone-host"].rstrip().endswith(" -")
