"""`gpumarket data` and `artifacts`: datasets in, a rental's synced output out. The bytes go
through gpumarket_cli.transfer, loaded only by these commands."""

from __future__ import annotations

import argparse

from gpumarket_cli.api import CliError
from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpumarket_cli.api import Api

COMMANDS = ("data", "artifacts")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="datasets: push, ls, rm")
    data_sub = data.add_subparsers(dest="data_command", required=True, prog="gpumarket data")
    push = data_sub.add_parser("push", help="upload a file or a directory as a dataset")
    push.add_argument("path")
    push.add_argument("--name", help="the dataset's name (default: the file or folder name)")
    data_sub.add_parser("ls", help="your datasets")
    data_sub.add_parser("rm", help="delete a dataset").add_argument("dataset", help="name or id")
    artifacts = sub.add_parser("artifacts", help="a rental's synced output: ls, pull")
    artifacts_sub = artifacts.add_subparsers(
        dest="artifacts_command", required=True, prog="gpumarket artifacts"
    )
    artifacts_sub.add_parser("ls").add_argument("rental")
    pull = artifacts_sub.add_parser("pull", help="download a rental's output files")
    pull.add_argument("rental")
    pull.add_argument("dest", nargs="?", help="a folder (default: the rental id)")


def _data_run(args: argparse.Namespace, api: Api) -> str:
    """Datasets: push a file or directory, list them, remove one by name (or id)."""
    from gpumarket_cli import transfer

    if args.data_command == "push":
        from pathlib import Path

        root = Path(args.path)
        dataset = transfer.push(api, root, args.name or root.resolve().name)
        return f"{dataset['id']} {dataset['name']} {dataset['status']} {dataset['total_bytes']} B"
    rows = list(transfer.pages(api, "/api/v1/datasets/"))
    api.last = rows
    if args.data_command == "ls":
        columns = ["id", "name", "status", "total_bytes", "file_count", "uploaded_by", "created_at"]
        return table(rows, columns) if rows else "no datasets"
    match = [d for d in rows if args.dataset in (d["name"], d["id"])]
    if not match:
        raise CliError(f"no dataset {args.dataset}")
    api.call("DELETE", f"/api/v1/datasets/{match[0]['id']}/")
    return f"removed {match[0]['name']}"


def _artifacts_run(args: argparse.Namespace, api: Api) -> str:
    from gpumarket_cli import transfer

    if args.artifacts_command == "pull":
        from pathlib import Path

        dest = Path(args.dest or args.rental)
        written = transfer.pull(api, args.rental, dest)
        api.last = {"files": [str(path) for path in written]}
        return f"{len(written)} file{'' if len(written) == 1 else 's'} in {dest}"
    rows = list(transfer.pages(api, f"/api/v1/rentals/{args.rental}/artifacts/"))
    api.last = rows
    return table(rows, ["path", "size_bytes", "reason", "synced_at"]) if rows else "none"


def run(args: argparse.Namespace, api: Api) -> str:
    if args.command == "data":
        return _data_run(args, api)
    return _artifacts_run(args, api)
