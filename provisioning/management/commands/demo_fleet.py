"""Start the demo hosts' agents: `manage.py demo_fleet --server URL [-- AGENT FLAGS]`.

Prepares their settings with the database at hand (`provisioning.demo.demo_fleet_prepare`: fresh
join tokens where the stored ones cannot work), then becomes `python -m nodeagent.fleet` (the
agents import no Django), keeping the process id that a supervisor watches. A restart therefore
heals a refused node token instead of failing the same way again.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from django.core.management.base import BaseCommand
from django.db import connections

from provisioning.demo import demo_fleet_prepare


class Command(BaseCommand):
    help = "Prepare the demo hosts' agents and run them (one process, simulated GPUs)."

    def add_arguments(self, parser):
        parser.add_argument("--server", required=True, help="the server URL the agents reach")
        parser.add_argument("--var-dir", help="the stack's data folder (default .var/dev)")
        parser.add_argument("agent_args", nargs="*", help="flags for every agent, after --")

    def handle(self, *args, server: str, var_dir: str | None, agent_args: list[str], **options):
        path = demo_fleet_prepare(var_dir=Path(var_dir) if var_dir else None, server_url=server)
        connections.close_all()
        sys.stdout.flush()
        sys.stderr.flush()
        python = sys.executable
        os.execv(python, [python, "-m", "nodeagent.fleet", str(path), *agent_args])  # noqa: S606
