"""Shared fixtures: real PostgreSQL through pytest-django, real services to build data, a real
SMTP server that keeps what it receives."""

from __future__ import annotations

import base64
import contextlib
import email
import email.policy
import hashlib
import hmac
import importlib
import itertools
import os
import re
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from accounts.models import Team
from accounts.services import api_token_create, team_personal_ensure
from marketplace.models import NodeStatus, Provider, User
from marketplace.services import GpuSpec, cluster_for_join, node_register
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from tests.factories import ProviderFactory, UserFactory, personal_team

_host_seq = itertools.count(1)


@pytest.fixture
def user(db) -> User:
    return UserFactory()


@pytest.fixture
def team(user) -> Team:
    """`user`'s personal team (made with the user), which owns what they rent."""
    return team_personal_ensure(user=user)


@pytest.fixture
def provider(db) -> Provider:
    return ProviderFactory()


@pytest.fixture
def make_join_token(provider):
    """make_join_token(region=, price=, min_bid=) -> a one-time join token of `provider`."""
    from provisioning.services import join_token_create

    def make(region: str = "eu-west", price: str = "1.20", min_bid: str = "0.40") -> str:
        return join_token_create(
            provider=provider,
            created_by=provider.owner,
            region=region,
            price_per_gpu_hour=Decimal(price),
            min_bid_per_gpu_hour=Decimal(min_bid),
        )[1]

    return make


@pytest.fixture
def join_token(make_join_token) -> str:
    """A one-time join token of `provider` for region eu-west."""
    return make_join_token()


@pytest.fixture
def api() -> APIClient:
    return APIClient()


@pytest.fixture
def auth_api(user) -> APIClient:
    """An API client authenticated by a real bearer token of `user` for their personal team."""
    _, raw = api_token_create(user=user, team=personal_team(user), name="tests")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def make_node(provider):
    """Register a node through the real service; GPUs get groups of `group_size`. Nodes share
    the provider's cluster "fabric" (InfiniBand 200 Gb/s), so may host one gang together,
    unless `cluster` names another or is None (a node on its own)."""

    def make(
        *,
        card: str = "a100-sxm4-80gb",
        gpus: int = 8,
        price: str = "1.00",
        min_bid: str | None = None,
        region: str = "eu-west",
        status: str = NodeStatus.ONLINE,
        reliability: str = "0.95",
        nvlink: bool = False,
        group_size: int = 8,
        hostname: str | None = None,
        pool: str = "default",
        cluster: str | None = "fabric",
    ):
        n = next(_host_seq)
        fabric = None
        if cluster is not None:
            fabric = cluster_for_join(
                provider=provider, name=cluster, interconnect="infiniband", bandwidth_gbps=200
            )
        return node_register(
            provider=provider,
            hostname=hostname or f"node{n}",
            region=region,
            cpu_cores=8 * gpus,
            ram_gb=64 * gpus,
            disk_gb=500 * gpus,
            price_per_gpu_hour=Decimal(price),
            min_bid_per_gpu_hour=Decimal(min_bid) if min_bid else Decimal(price) / 2,
            gpus=[
                GpuSpec(
                    index=i,
                    uuid=f"GPU-{uuid.uuid4()}",
                    model_slug=card,
                    topology_group=f"g{i // group_size}",
                )
                for i in range(gpus)
            ],
            status=status,
            nvlink=nvlink,
            reliability=Decimal(reliability),
            pool=pool,
            cluster=fabric,
            internet_filtered=True,  # as the agent of a host whose engine filters says
        )

    return make


@pytest.fixture(autouse=True)
def _catalog(request):
    """Transactional tests flush every table, the migrated catalog included: load it again."""
    if "transactional_db" not in request.fixturenames and not any(
        m.kwargs.get("transaction") for m in request.node.iter_markers("django_db")
    ):
        yield
        return
    from django.apps import apps

    from marketplace.models import GpuModel

    if not GpuModel.objects.exists():
        importlib.import_module("marketplace.migrations.0002_gpu_catalog").load(apps, None)
    yield


@pytest.fixture(autouse=True)
def _telemetry_outbox():
    """Heartbeats leave their samples in the process's outbox; an earlier test's are not this
    test's (its nodes are gone, and a test counts what it flushes)."""
    from provisioning.services import telemetry_outbox_discard

    telemetry_outbox_discard()
    yield


@pytest.fixture
def rent(user):
    """Create a rental through the real service."""

    def make(gpus: int = 1, *, customer=None, team=None, **kwargs):
        for name in ("max_price_per_gpu_hour", "bid_per_gpu_hour", "min_tensor_tflops"):
            if isinstance(kwargs.get(name), str):
                kwargs[name] = Decimal(kwargs[name])
        kwargs.setdefault("duration_s", 3600)
        customer = customer or user
        return rental_create(
            customer=customer,
            team=team or personal_team(customer),
            request=RentalRequest(
                gpus_per_node=gpus,
                runtime=kwargs.pop("runtime", RuntimeSpec(image="gpumarket/harness:dev")),
                **kwargs,
            ),
        )

    return make


S3_VARIABLES = ("S3_ENDPOINT_URL", "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY", "S3_REGION")


@pytest.fixture(scope="session")
def object_store_env(tmp_path_factory):
    """A real S3 store with a fresh bucket for this session: the one S3_ENDPOINT_URL names (the
    test command starts SeaweedFS), else an embedded SeaweedFS started here by the same code as
    `dev.py up` (devstack.embedded), its variables exported for processes the tests start."""
    from devstack.embedded import bucket_ensure, start_seaweedfs, stop_process

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    if os.environ.get("S3_ENDPOINT_URL"):
        env = {name: os.environ.get(name, "") for name in S3_VARIABLES}
        env["S3_REGION"] = env["S3_REGION"] or "us-east-1"
        env["S3_BUCKET"] = bucket
        bucket_ensure(env)
        yield env
        return
    env, proc = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), bucket=bucket)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        stop_process(proc)


@pytest.fixture
def object_store(object_store_env, settings):
    """Point the server at the session's store; a boto3 client of it for assertions."""
    from devstack.embedded import s3_client

    for name, value in object_store_env.items():
        setattr(settings, name, value)
    settings.S3_PUBLIC_ENDPOINT_URL = ""
    client = s3_client(object_store_env)
    client.bucket = object_store_env["S3_BUCKET"]
    return client


@pytest.fixture
def bucket_keys(object_store):
    """keys(prefix) -> every key in the session's bucket under prefix, sorted."""

    def keys(prefix: str = "") -> list[str]:
        pages = object_store.get_paginator("list_objects_v2").paginate(
            Bucket=object_store.bucket, Prefix=prefix
        )
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    return keys


@dataclass
class Mailbox:
    """What the test SMTP server received, as parsed messages, in order."""

    messages: list[email.message.EmailMessage] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __len__(self) -> int:
        with self.lock:
            return len(self.messages)

    def __iter__(self):
        with self.lock:
            return iter(list(self.messages))

    def __getitem__(self, index: int) -> email.message.EmailMessage:
        with self.lock:
            return self.messages[index]

    def to(self, address: str) -> list[email.message.EmailMessage]:
        with self.lock:
            return [m for m in self.messages if address.lower() in m["To"].lower()]

    def wait_for(self, address: str, *, count: int = 1, timeout: float = 30) -> list:
        """The messages to `address` once there are `count` of them (mail is sent in the
        request, but a browser test reads the box from another thread)."""
        deadline = time.monotonic() + timeout
        while len(found := self.to(address)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"no mail #{count} to {address}: got {len(found)}")
            time.sleep(0.1)
        return found

    @staticmethod
    def body(message: email.message.EmailMessage) -> str:
        part = message.get_body(preferencelist=("plain", "html"))
        return part.get_content() if part is not None else ""

    def link(self, address: str, pattern: str, *, index: int = -1) -> str:
        """The first URL matching `pattern` in a message to `address` (the latest by default)."""
        message = self.wait_for(address, count=1 if index == -1 else index + 1)[index]
        for url in re.findall(r"https?://[^\s<>\"]+", self.body(message)):
            if re.search(pattern, url):
                return url
        raise AssertionError(f"no link matching {pattern!r} in: {self.body(message)}")


class _Keep:
    def __init__(self, box: Mailbox) -> None:
        self.box = box

    async def handle_DATA(self, server, session, envelope):
        parsed = email.message_from_bytes(envelope.content, policy=email.policy.default)
        with self.box.lock:
            self.box.messages.append(parsed)
        return "250 Message accepted for delivery"


@pytest.fixture
def smtp_server(settings):
    """A real SMTP server (aiosmtpd) on a free port; Django's SMTP backend sends to it."""
    from aiosmtpd.controller import Controller

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box = Mailbox()
    controller = Controller(_Keep(box), hostname="127.0.0.1", port=port)
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = port
    settings.EMAIL_USE_TLS = False
    settings.EMAIL_HOST_USER = ""
    settings.EMAIL_HOST_PASSWORD = ""
    yield box
    controller.stop()


def totp_code(secret: str, *, steps_ahead: int = 0, period: int = 30, digits: int = 6) -> str:
    """RFC 6238 TOTP (HMAC-SHA1) computed here, independently of the server's code, as an
    authenticator app would. `steps_ahead` gives a later period's code: the server refuses a
    code used once, and accepts one period either side."""
    key = base64.b32decode(secret.upper() + "=" * (-len(secret) % 8))
    counter = int(time.time()) // period + steps_ahead
    digest = hmac.new(key, struct.pack(">Q", counter), hashlib.sha1).digest()
    offset = digest[-1] & 0x0F
    value = struct.unpack(">I", digest[offset : offset + 4])[0] & 0x7FFFFFFF
    return f"{value % 10**digits:0{digits}d}"
