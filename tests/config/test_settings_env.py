"""Settings read the environment literally: a value that starts with "$" is that value, not
the name of another variable (django-environ's proxy syntax), so a secret drawn at random
keeps its meaning in every process of a deployment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

READ = (
    "import json, django; django.setup(); from django.conf import settings; "
    "print(json.dumps([settings.SECRET_KEY, settings.EMAIL_HOST_PASSWORD, settings.EMAIL_PORT]))"
)


def _settings_in_a_new_process(**env: str) -> list:
    environment = {
        k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "GPUMARKET_EPHEMERAL_SECRET"}
    }
    environment.update(DJANGO_SETTINGS_MODULE="config.settings.base", DEBUG="0", **env)
    out = subprocess.run(
        [sys.executable, "-c", READ], env=environment, cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def test_a_secret_that_starts_with_a_dollar_is_kept_as_it_is():
    # given secrets that start with "$", one of them also the name of a set variable
    key, password = "$k9!x(-_=+)abc" * 4, "$HOME"
    # when a process reads its settings
    secret_key, email_password, port = _settings_in_a_new_process(
        SECRET_KEY=key, EMAIL_HOST_PASSWORD=password, EMAIL_PORT="2525"
    )
    # then each is the value given, not another variable's value nor a default
    assert secret_key == key
    assert email_password == "$HOME"
    assert port == 2525


def test_two_processes_given_the_same_key_derive_the_same_webhook_secret():
    # given the key a deployment shares, starting with "$"
    key = "$" + "a1" * 30
    derive = (
        "import django; django.setup(); from notifications.webhooks import webhook_secret; "
        "print(webhook_secret('salt'))"
    )
    environment = {
        **os.environ,
        "SECRET_KEY": key,
        "DJANGO_SETTINGS_MODULE": "config.settings.base",
    }
    environment.pop("GPUMARKET_EPHEMERAL_SECRET", None)
    # when two processes derive a webhook's signing secret from one salt
    first, second = (
        subprocess.run(
            [sys.executable, "-c", derive], env=environment, cwd=ROOT, capture_output=True,
            text=True, timeout=120, check=True,
        ).stdout.split()[-1]
        for _ in range(2)
    )  # fmt: skip
    # then they agree (a random per-process key would make them differ)
    assert first == second


def test_production_refuses_to_start_without_the_secrets_keys():
    # given a deployment's environment with SECRET_KEY but no SECRETS_ENCRYPTION_KEYS
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in {"GPUMARKET_EPHEMERAL_SECRET", "SECRETS_ENCRYPTION_KEYS", "DEBUG"}
    }
    environment.update(DJANGO_SETTINGS_MODULE="config.settings.base", SECRET_KEY="k" * 50)
    read = "import django; django.setup(); from django.conf import settings; " + (
        "print(settings.SECRETS_ENCRYPTION_KEYS)"
    )
    # when a process starts, then it refuses, naming the setting
    refused = subprocess.run(
        [sys.executable, "-c", read], env=environment, cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "SECRETS_ENCRYPTION_KEYS is not set" in refused.stderr
    # and given two keys, newest first, it starts with both
    environment["SECRETS_ENCRYPTION_KEYS"] = "$new-key,old-key"
    started = subprocess.run(
        [sys.executable, "-c", read], env=environment, cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    assert started.stdout.split("\n")[-2] == "['$new-key', 'old-key']"
