"""Shared fixtures: real PostgreSQL through pytest-django, real services to build data."""

from __future__ import annotations

import importlib
import itertools
import uuid
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from marketplace.models import NodeStatus, Provider, User
from marketplace.services import GpuSpec, api_token_create, node_register
from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create
from tests.factories import ProviderFactory, UserFactory

_host_seq = itertools.count(1)


@pytest.fixture
def user(db) -> User:
    return UserFactory()


@pytest.fixture
def provider(db) -> Provider:
    return ProviderFactory()


@pytest.fixture
def api() -> APIClient:
    return APIClient()


@pytest.fixture
def auth_api(user) -> APIClient:
    """An API client authenticated by a real bearer token of `user`."""
    _, raw = api_token_create(user=user, name="tests")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


@pytest.fixture
def make_node(provider):
    """Register a node through the real service; GPUs get groups of `group_size`."""

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
    ):
        n = next(_host_seq)
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


@pytest.fixture
def rent(user):
    """Create a rental through the real service."""

    def make(gpus: int = 1, *, customer=None, **kwargs):
        for name in ("max_price_per_gpu_hour", "bid_per_gpu_hour", "min_tensor_tflops"):
            if isinstance(kwargs.get(name), str):
                kwargs[name] = Decimal(kwargs[name])
        kwargs.setdefault("duration_s", 3600)
        return rental_create(
            customer=customer or user,
            request=RentalRequest(
                gpus_per_node=gpus, runtime=RuntimeSpec(image="gpumarket/harness:dev"), **kwargs
            ),
        )

    return make


@pytest.fixture
def smtp_server(settings):
    """A real SMTP server (aiosmtpd) on a free port, with Django's SMTP backend pointed at it.
    Yields the list the received messages (email.message.Message) are appended to."""
    import contextlib
    import email
    import socket

    from aiosmtpd.controller import Controller

    received: list = []

    class Handler:
        async def handle_DATA(self, server, session, envelope):
            message = email.message_from_bytes(envelope.content)
            message["X-Envelope-To"] = ", ".join(envelope.rcpt_tos)
            received.append(message)
            return "250 OK"

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    controller = Controller(Handler(), hostname="127.0.0.1", port=port)
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    try:
        yield received
    finally:
        controller.stop()
