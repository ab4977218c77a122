"""The README's quickstart runs as written: each `gpumarket` line of the block after the
`<!-- quickstart -->` marker, through the installed CLI, against the stack as `dev.py up` runs it
(the demo hosts' agents, simulated GPUs on the local-process runtime): it rents a demo H100."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from accounts.services import api_token_create
from marketplace.models import Node, Rental, RentalStatus
from tests.e2e.conftest import ROOT, wait_for
from tests.factories import personal_team

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

GPUMARKET = str(Path(sys.executable).parent / "gpumarket")


def quickstart_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- quickstart -->\n```sh\n(.*?)```", text, re.S)
    assert match, "README.md has no quickstart block"
    return [line for line in match.group(1).splitlines() if line.strip()]


def test_the_quickstart_block_runs_as_written(start_demo_stack, user):
    from billing.services.ledger import account_adjust, account_for_team

    account = account_for_team(team=personal_team(user))
    account_adjust(account_id=account.pk, amount_micros=20_000_000, reason="demo", actor=None)
    stack = start_demo_stack(env={"BILLING_FUNDS_CHECK": "1"})
    wait_for(
        lambda: Node.objects.filter(gpu_model__slug="h100-sxm5-80gb", status="online").count() == 2,
        120,
        "the demo H100 hosts to join",
    )
    env = {
        **stack.env,
        "GPUMARKET_SERVER_URL": stack.url,
        "GPUMARKET_TOKEN": api_token_create(user=user, team=personal_team(user), name="readme")[1],
    }
    lines = quickstart_lines()
    assert lines[0].startswith("export GPUMARKET_SERVER_URL=")
    rental_id = ""
    outputs = {}
    for line in lines[1:]:
        argv = shlex.split(line.replace("RENTAL_ID", rental_id), comments=True)
        assert argv[0] == "gpumarket", line
        done = subprocess.run(
            [GPUMARKET, *argv[1:]], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
        outputs[argv[1]] = done.stdout
        if argv[1] == "rent":
            rental_id = done.stdout.split()[0]
            # The harness image without a command trains on the local-process runtime too.
            rid = rental_id
            wait_for(lambda r=rid: _status(r) == RentalStatus.RUNNING, 180, "the rental runs")
            wait_for(lambda r=rid: _has_steps(env, r), 180, "training steps")
    assert "fra-h100-01" in outputs["offers"] and "fra-h100-02" in outputs["offers"]
    assert "h100-sxm5-80gb" in outputs["advise"]
    placed = Node.objects.get(allocations__rental_id=rental_id)
    assert placed.hostname.startswith("fra-h100-")
    assert rental_id in outputs["rentals"]
    assert "balance $" in outputs["balance"]
    wait_for(lambda: _status(rental_id) == RentalStatus.COMPLETED, 120, "the stop to complete")
    assert Rental.objects.get(pk=rental_id).status_reason == "stopped"


def _status(rental_id: str) -> str:
    return Rental.objects.values_list("status", flat=True).get(pk=rental_id)


def _has_steps(env: dict[str, str], rental_id: str) -> bool:
    done = subprocess.run(
        [GPUMARKET, "metrics", rental_id], env=env, capture_output=True, text=True, timeout=60
    )
    return done.returncode == 0 and len(done.stdout.splitlines()) > 1
