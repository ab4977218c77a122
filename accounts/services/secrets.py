"""Team secrets: stored encrypted, never read back by a person, decrypted only to build the run
spec of a rental that names them (for the node running it), and masked in what a run prints.

Encryption is Fernet (AES-128-CBC with HMAC-SHA256) with settings.SECRETS_ENCRYPTION_KEYS
through MultiFernet: the first key encrypts, any of them decrypts, and `secrets_reencrypt`
moves every value to the first key, after which an old key can be dropped.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction

from accounts.models import Team, TeamSecret
from core.errors import NotFound, ValidationFailed

User = get_user_model()

NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# Set by the platform in every run: a secret of that name would be overridden or override it.
RESERVED_PREFIXES = ("GPUMARKET_", "NVIDIA_", "CUDA_VISIBLE", "HARNESS_")
MAX_VALUE_BYTES = 64 * 1024
MAX_SECRETS_PER_TEAM = 100


def secret_name_check(name: object, *, field: str = "name") -> str:
    """The name as given when it can name an environment variable; ValidationFailed on `field`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValidationFailed(
            "a secret's name is a variable name: letters, digits and _, not starting with a "
            "digit, at most 64 characters",
            field=field,
        )
    if name.upper().startswith(RESERVED_PREFIXES):
        raise ValidationFailed(f"{name} is set by the platform", field=field)
    return name


def _value_check(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationFailed("give the secret's value (text)", field="value")
    if "\x00" in value:
        raise ValidationFailed("a secret's value cannot hold NUL bytes", field="value")
    if len(value.encode()) > MAX_VALUE_BYTES:
        raise ValidationFailed(f"at most {MAX_VALUE_BYTES // 1024} KiB", field="value")
    return value


@functools.cache
def _box(keys: tuple[str, ...]) -> MultiFernet:
    try:
        return MultiFernet([Fernet(key) for key in keys])
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(
            f"SECRETS_ENCRYPTION_KEYS holds a key that is not a Fernet key: {exc}"
        ) from None


def box() -> MultiFernet:
    keys = tuple(k for k in settings.SECRETS_ENCRYPTION_KEYS if k)
    if not keys:
        raise ImproperlyConfigured("SECRETS_ENCRYPTION_KEYS is empty")
    return _box(keys)


def _decrypt(secret: TeamSecret) -> str:
    try:
        return box().decrypt(secret.ciphertext.encode()).decode()
    except InvalidToken:
        # Not a customer's fault: the keys lost the one it was written with.
        raise ImproperlyConfigured(
            f"team secret {secret.pk} cannot be decrypted with SECRETS_ENCRYPTION_KEYS"
        ) from None


def secret_set(*, team: Team, actor: User, name: str, value: str) -> tuple[TeamSecret, bool]:
    """Create the team's secret `name`, or replace its value; (secret, created)."""
    secret_name_check(name)
    ciphertext = box().encrypt(_value_check(value).encode()).decode()
    with transaction.atomic():
        existing = TeamSecret.objects.select_for_update().filter(team=team, name=name).first()
        if existing is not None:
            existing.ciphertext = ciphertext
            existing.save(update_fields=["ciphertext", "updated_at"])
            return existing, False
        if TeamSecret.objects.filter(team=team).count() >= MAX_SECRETS_PER_TEAM:
            raise ValidationFailed(
                f"a team keeps at most {MAX_SECRETS_PER_TEAM} secrets", field="name"
            )
        try:
            with transaction.atomic():
                secret = TeamSecret.objects.create(
                    team=team, name=name, ciphertext=ciphertext, created_by=actor
                )
        except IntegrityError:  # the same name set concurrently: that one is replaced
            secret = TeamSecret.objects.select_for_update().get(team=team, name=name)
            secret.ciphertext = ciphertext
            secret.save(update_fields=["ciphertext", "updated_at"])
            return secret, False
    return secret, True


def secret_delete(*, team: Team, name: str) -> None:
    """Delete one of the team's secrets; rentals already running keep what they were given,
    later ones naming it are refused. Another team's name is not found."""
    deleted, _ = TeamSecret.objects.filter(team=team, name=name).delete()
    if not deleted:
        raise NotFound("no such secret", field="name")


def secrets_missing(*, team: Team, names: Iterable[str]) -> list[str]:
    """The names among `names` the team has no secret of, sorted."""
    wanted = set(names)
    have = set(TeamSecret.objects.filter(team=team, name__in=wanted).values_list("name", flat=True))
    return sorted(wanted - have)


def secret_values(*, pairs: Iterable[tuple[int, str]]) -> dict[tuple[int, str], str]:
    """(team id, name) -> the decrypted value, for building run specs; a name deleted since
    the rental was made is absent."""
    pairs = set(pairs)
    if not pairs:
        return {}
    rows = TeamSecret.objects.filter(
        team_id__in={team for team, _ in pairs}, name__in={name for _, name in pairs}
    )
    return {
        (row.team_id, row.name): _decrypt(row) for row in rows if (row.team_id, row.name) in pairs
    }


def secrets_reencrypt() -> int:
    """Re-encrypt every secret with the first key (after a new one was put first); returns how
    many were rewritten."""
    count = 0
    for secret in TeamSecret.objects.only("pk", "ciphertext").iterator():
        rotated = box().rotate(secret.ciphertext.encode()).decode()
        TeamSecret.objects.filter(pk=secret.pk, ciphertext=secret.ciphertext).update(
            ciphertext=rotated
        )
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class RegistryCredentials:
    username: str
    password: str


def registry_credentials(value: str, *, secret: str) -> RegistryCredentials:
    """A registry secret's value: `{"username": .., "password": ..}` or `user:password`;
    ValidationFailed on `registry_secret` otherwise."""
    username = password = None
    try:
        data = json.loads(value)
    except ValueError:
        data = None
    if isinstance(data, Mapping):
        username, password = data.get("username"), data.get("password")
    elif ":" in value and "\n" not in value.strip():
        username, _, password = value.strip().partition(":")
    if not isinstance(username, str) or not isinstance(password, str) or not username:
        raise ValidationFailed(
            f'secret {secret} is not registry credentials: {{"username": .., "password": ..}} '
            "or user:password",
            field="registry_secret",
        )
    return RegistryCredentials(username=username, password=password)


SECRETS_DIR = "/run/secrets"
MAX_SECRETS_PER_RENTAL = 32
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def secret_uses_parse(raw: object, *, field: str = "secrets") -> list[dict[str, str]]:
    """How a rental (or template) uses the team's secrets, as stored: `[{"name", "env",
    "file"}]`. Given as a list of names (each the variable of its own name), or as an object
    name -> {"env": VAR} and/or {"file": "/run/secrets/FILE"} ({"file": true}: the secret's
    name; {} or null: the variable of its name). ValidationFailed on `field`."""
    if raw is None:
        return []
    if isinstance(raw, list):
        items = [(name, None) for name in raw]
    elif isinstance(raw, Mapping):
        items = list(raw.items())
    else:
        raise ValidationFailed("a list of secret names, or an object name -> use", field=field)
    if len(items) > MAX_SECRETS_PER_RENTAL:
        raise ValidationFailed(f"at most {MAX_SECRETS_PER_RENTAL} secrets", field=field)
    uses, envs, files, names = [], set(), set(), set()
    for name, how in items:
        secret_name_check(name, field=field)
        if name in names:
            raise ValidationFailed(f"{name} is named twice", field=field)
        names.add(name)
        if how is None or how == {}:
            how = {"env": name}
        if not isinstance(how, Mapping) or not how or set(how) - {"env", "file"}:
            raise ValidationFailed(
                f'{name}: {{"env": "VAR"}} and/or {{"file": "{SECRETS_DIR}/FILE"}}', field=field
            )
        env, file = how.get("env", ""), how.get("file", "")
        if env:
            secret_name_check(env, field=field)
        elif env != "":
            raise ValidationFailed(f"{name}: env is a variable name", field=field)
        if file is True:
            file = f"{SECRETS_DIR}/{name}"
        if file:
            base = file.removeprefix(f"{SECRETS_DIR}/") if isinstance(file, str) else ""
            if base == file or not _FILE_NAME_RE.fullmatch(base):
                raise ValidationFailed(
                    f"{name}: a file is {SECRETS_DIR}/FILE (letters, digits, _ . -)", field=field
                )
        elif file not in ("", False):
            raise ValidationFailed(f"{name}: file is a path under {SECRETS_DIR}", field=field)
        if (env and env in envs) or (file and file in files):
            raise ValidationFailed(f"{name}: {env or file} is given twice", field=field)
        envs.add(env)
        files.add(file)
        uses.append({"name": name, "env": env, "file": file or ""})
    return uses
