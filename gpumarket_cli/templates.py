"""`gpumarket template`: the team's saved rental runtimes (image, command, env, ports, datasets,
harness config, SSH), and the flags `rent` shares with it."""

from __future__ import annotations

import argparse

from gpumarket_cli.api import CliError
from gpumarket_cli.output import table

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpumarket_cli.api import Api

COMMANDS = ("template",)


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """What runs, as `rent` and `template save` both take it."""
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="repeatable"
    )
    parser.add_argument(
        "--port", action="append", default=[], type=int, help="a published port (repeatable)"
    )
    parser.add_argument(
        "--harness-config", metavar="FILE", help="a JSON file: the training harness's config"
    )
    parser.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="a team secret the run gets as $NAME (repeatable; NAME=file: as /run/secrets/NAME)",
    )
    parser.add_argument(
        "--registry-secret", metavar="NAME", help="the team secret the image is pulled with"
    )


def secrets_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The request's `secrets` and `registry_secret`, as the flags give them (none unused)."""
    body: dict[str, Any] = {}
    if args.secret:
        uses: dict[str, Any] = {}
        for item in args.secret:
            name, _, how = item.partition("=")
            if how not in ("", "file"):
                raise CliError(f"--secret {item!r}: give NAME or NAME=file")
            uses[name] = {"file": True} if how == "file" else {}
        body["secrets"] = uses
    if args.registry_secret:
        body["registry_secret"] = args.registry_secret
    return body


def runtime_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The runtime keys the flags give (none for a flag not used)."""
    runtime: dict[str, Any] = {}
    if getattr(args, "image", None):
        runtime["image"] = args.image
    if args.cmd:
        runtime["command"] = args.cmd
    if args.env:
        env = {}
        for item in args.env:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise CliError(f"--env {item!r}: give NAME=VALUE")
            env[name] = value
        runtime["env"] = env
    if args.port:
        runtime["ports"] = args.port
    if args.harness_config:
        import json

        try:
            with open(args.harness_config, encoding="utf-8") as file:
                runtime["harness_config"] = json.load(file)
        except (OSError, ValueError) as exc:
            raise CliError(f"--harness-config {args.harness_config}: {exc}") from exc
    return runtime


def add_parsers(sub: argparse._SubParsersAction) -> None:
    template = sub.add_parser("template", help="your team's rental templates: save, ls, show, rm")
    template_sub = template.add_subparsers(
        dest="template_command", required=True, prog="gpumarket template"
    )
    save = template_sub.add_parser(
        "save", help="save what a rental runs by name (-- CMD ... for the command)"
    )
    save.add_argument("name")
    save.add_argument("--image", required=True)
    save.add_argument("--description", default="")
    save.add_argument("--data", action="append", default=[], help="a dataset (repeatable)")
    save.add_argument("--ssh", action="store_true", help="an sshd for your SSH keys")
    save.add_argument(
        "--network", choices=["internet", "internal"], default="internet",
        help="the rental's network: internet (public addresses only) or internal (none)",
    )  # fmt: skip
    save.add_argument("--replace", action="store_true", help="replace a template of this name")
    add_runtime_flags(save)
    save.add_argument("cmd", nargs="*", help="the command (after --)")
    template_sub.add_parser("ls", help="the team's templates")
    template_sub.add_parser("show", help="one template").add_argument("name")
    template_sub.add_parser("rm", help="delete a template").add_argument("name")


def run(args: argparse.Namespace, api: Api) -> str:
    command = args.template_command
    if command == "save":
        body = {
            **runtime_from_flags(args),
            "description": args.description,
            "datasets": args.data,
            "ssh": args.ssh,
            "network": args.network,
            **secrets_from_flags(args),
        }
        if args.replace:
            saved = api.call("PUT", f"/api/v1/templates/{args.name}/", json=body)
        else:
            saved = api.call("POST", "/api/v1/templates/", json={"name": args.name, **body})
        return f"saved {saved['name']}"
    if command == "ls":
        rows = api.call("GET", "/api/v1/templates/")["results"]
        return (
            table(rows, ["name", "image", "description", "updated_at"])
            if rows
            else ("no templates")
        )
    if command == "show":
        t = api.call("GET", f"/api/v1/templates/{args.name}/")
        lines = [f"{t['name']}  {t['description']}".rstrip()]
        lines.append(f"image    {' '.join([t['image'], *t['command']])}")
        lines += [f"env      {name}={value}" for name, value in t["env"].items()]
        if t["ports"]:
            lines.append(f"ports    {', '.join(map(str, t['ports']))}")
        if t["datasets"]:
            lines.append(f"datasets {', '.join(t['datasets'])}")
        if t["harness_config"] is not None:
            import json

            lines.append(f"harness  {json.dumps(t['harness_config'], sort_keys=True)}")
        lines.append(f"ssh      {'yes' if t['ssh'] else 'no'}")
        lines.append(f"network  {t.get('network', 'internet')}")
        if t.get("secrets"):
            lines.append(f"secrets  {', '.join(use['name'] for use in t['secrets'])}")
        if t.get("registry_secret"):
            lines.append(f"registry {t['registry_secret']}")
        return "\n".join(lines)
    api.call("DELETE", f"/api/v1/templates/{args.name}/")
    return f"removed {args.name}"
