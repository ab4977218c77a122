"""Rental templates: a team's saved runtimes, and a rental request started from one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.db import IntegrityError, transaction

from accounts.models import Team
from core.errors import Conflict, NotFound, ValidationFailed
from marketplace.models import RentalTemplate, User

# What a template holds: the rental request's runtime, datasets, SSH, network and secrets.
TEMPLATE_FIELDS = (
    "description", "image", "command", "env", "ports", "datasets", "harness_config", "secrets",
    "registry_secret",
)  # fmt: skip
MAX_TEMPLATES_PER_TEAM = 200


def template_save(
    *, team: Team, actor: User, name: str, values: Mapping[str, Any], replace: bool
) -> RentalTemplate:
    """Create the team's template `name` (409 when it exists), or replace it (`replace`: PUT)."""
    fields = {key: values[key] for key in (*TEMPLATE_FIELDS, "ssh", "network") if key in values}
    with transaction.atomic():
        existing = RentalTemplate.objects.select_for_update().filter(team=team, name=name).first()
        if existing is not None:
            if not replace:
                raise Conflict(f"the team has a template named {name!r}", field="name")
            defaults = RentalTemplate(team=team, name=name)
            for key in (*TEMPLATE_FIELDS, "ssh", "network"):
                setattr(existing, key, fields.get(key, getattr(defaults, key)))
            existing.save()
            return existing
        if RentalTemplate.objects.filter(team=team).count() >= MAX_TEMPLATES_PER_TEAM:
            raise ValidationFailed(
                f"a team keeps at most {MAX_TEMPLATES_PER_TEAM} templates", field="name"
            )
        try:
            with transaction.atomic():
                return RentalTemplate.objects.create(
                    team=team, name=name, created_by=actor, **fields
                )
        except IntegrityError as exc:  # a concurrent create of the same name
            raise Conflict(f"the team has a template named {name!r}", field="name") from exc


def template_delete(*, team: Team, name: str) -> None:
    deleted, _ = RentalTemplate.objects.filter(team=team, name=name).delete()
    if not deleted:
        raise NotFound("no such template")


def rental_body_from_template(*, team: Team, body: Mapping[str, Any]) -> dict:
    """A rental request body that names a `template`: the template's runtime, datasets, SSH
    and network under what the body gives (runtime keys given win; `env` is merged, the body's names
    winning). A name the team has no template of is a 400 naming `template`."""
    data = dict(body)
    name = data.pop("template")
    template = (
        RentalTemplate.objects.filter(team=team, name=name).first()
        if isinstance(name, str)
        else None
    )
    if template is None:
        raise ValidationFailed("the team has no template of this name", field="template")
    base = template.runtime()
    given = data.get("runtime")
    runtime = dict(base["runtime"])
    if isinstance(given, Mapping):
        env = given.get("env")
        runtime.update(given)
        if isinstance(env, Mapping):
            runtime["env"] = {**base["runtime"]["env"], **env}
    elif given is not None:
        runtime = given  # not an object: the rental's own validation names it
    data["runtime"] = runtime
    data.setdefault("datasets", base["datasets"])
    data.setdefault("ssh", base["ssh"])
    data.setdefault("network", base["network"])
    data.setdefault("secrets", base["secrets"])
    data.setdefault("registry_secret", base["registry_secret"])
    return data
