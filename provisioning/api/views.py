"""The agent API (node-token auth, throttled, size-limited) and the provider's join tokens."""

from __future__ import annotations

import ipaddress
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, TypeVar

import structlog
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions, permissions, status
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.services import token_hash
from accounts.tenancy import request_team
from agentprotocol import (
    ArtifactCommitAnswer,
    ArtifactUpload,
    ArtifactUploadAnswer,
    CachedImage,
    ContainerReport,
    GpuInfo,
    JoinAnswer,
    Message,
    PullProgress,
    UsageReport,
)
from agentprotocol.untrusted import json_loads_bounded
from core.api.guards import client_ip
from core.api.pagination import PaginatedListView
from core.api.throttles import RateThrottle
from core.errors import NotFound
from marketplace.lifecycle import TERMINAL
from marketplace.models import Node, Provider, Rental
from provisioning import services
from provisioning.api.serializers import (
    ArtifactCommitAnswerSerializer,
    ArtifactCommitSerializer,
    ArtifactUploadAnswerSerializer,
    ArtifactUploadRequestSerializer,
    HeartbeatAnswerSerializer,
    HeartbeatSerializer,
    JoinAnswerSerializer,
    JoinSerializer,
    JoinTokenCreateSerializer,
    RunLogLineSerializer,
    RunLogQuerySerializer,
    RunMetricQuerySerializer,
    RunMetricSerializer,
)
from provisioning.models import ContainerRun, RunLogLine, RunMetric
from storage.services import FileSpec, UploadedFile

M = TypeVar("M", bound=Message)

# A heartbeat carries at most a few hundred small records; anything bigger is not an agent.
MAX_BODY_BYTES = 1 << 20
# A heartbeat nests five levels (a benchmark's notes inside the benchmark); the parser recurses
# once per level, so a body of 100,000 `[` would take the server's stack with it.
MAX_BODY_DEPTH = 16


class AgentJSONParser(JSONParser):
    """JSON bodies from agents, read as untrusted: bounded in size and depth before parsing,
    NaN and Infinity refused; any of these is one 400 and nothing is applied."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            raise exceptions.ParseError(f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            return json_loads_bounded(raw, max_depth=MAX_BODY_DEPTH)
        except ValueError as exc:  # UnicodeDecodeError included
            raise exceptions.ParseError(f"JSON parse error - {str(exc)[:200]}") from None


class NodeAuthentication(BaseAuthentication):
    """`Authorization: Bearer gpn_...`: the node token; the request's `user` is the node."""

    @staticmethod
    def bearer(request) -> str:
        """The token as sent, not yet checked; 401 when there is none or it is malformed."""
        header = get_authorization_header(request).split()
        if len(header) != 2 or header[0].lower() != b"bearer":
            raise exceptions.AuthenticationFailed("node token required")
        try:
            return header[1].decode()
        except UnicodeError as exc:
            raise exceptions.AuthenticationFailed("malformed token") from exc

    def authenticate(self, request):
        raw = self.bearer(request)
        node = services.node_authenticate(raw)
        if node is None:
            raise exceptions.AuthenticationFailed("invalid or revoked node token")
        structlog.contextvars.bind_contextvars(node_id=node.pk)
        return node, raw

    def authenticate_header(self, request) -> str:
        return "Bearer"


class IsNode(permissions.BasePermission):
    def has_permission(self, request, view) -> bool:
        return isinstance(request.user, Node)


class NodeThrottle(RateThrottle):
    """Per-node request rate: a runaway agent cannot starve the others.

    Counted per node token (a node has one at a time), so the heartbeat can be counted before
    its token is checked with it."""

    scope = "agent"

    def ident(self, request) -> str | None:
        return f"node-{token_hash(NodeAuthentication.bearer(request))[:32]}"


class UnverifiedTokenThrottle(RateThrottle):
    """Heartbeats whose token this process has not yet seen valid, per client address: a caller
    with a new random token on each request gets a new per-token bucket, but not a new address.
    A real agent passes here about once per web process per VERIFIED_TOKEN_TTL_S."""

    scope = "agent_unverified"

    def ident(self, request) -> str | None:
        return client_ip(request)


# Node tokens this process saw valid lately (hash -> until, monotonic), oldest first. Only a
# shortcut past the check before the body: the heartbeat's own statement still checks the token
# every time, so a token revoked meanwhile is refused all the same.
VERIFIED_TOKEN_TTL_S = 300.0
_VERIFIED_TOKENS_MAX = 50_000
_verified_tokens: OrderedDict[str, float] = OrderedDict()
_verified_lock = threading.Lock()


def _token_verified_lately(digest: str) -> bool:
    with _verified_lock:
        until = _verified_tokens.get(digest)
        return until is not None and until > time.monotonic()


def _token_verified(digest: str) -> None:
    with _verified_lock:
        _verified_tokens[digest] = time.monotonic() + VERIFIED_TOKEN_TTL_S
        _verified_tokens.move_to_end(digest)
        while len(_verified_tokens) > _VERIFIED_TOKENS_MAX:
            _verified_tokens.popitem(last=False)


class JoinThrottle(RateThrottle):
    """Join attempts per client address, at the agents' rate: join tokens cannot be guessed
    at speed."""

    scope = "agent"
    counter = "join"

    def ident(self, request) -> str | None:
        return client_ip(request)


def _message(cls: type[M], validated: Mapping[str, Any]) -> M:
    """A protocol message from a serializer's validated data (ids back to their wire text)."""
    return cls.from_payload(
        {k: str(v) if isinstance(v, uuid.UUID) else v for k, v in validated.items()}
    )


def _check_size(request: Request) -> None:
    length = int(request.META.get("CONTENT_LENGTH") or 0)
    if length > MAX_BODY_BYTES:
        raise exceptions.ValidationError({"body": [f"larger than {MAX_BODY_BYTES} bytes"]})


class JoinView(APIView):
    """Exchange a provider's one-time join token for a node token."""

    authentication_classes: list = []
    permission_classes = [permissions.AllowAny]
    throttle_classes = [JoinThrottle]
    parser_classes = [AgentJSONParser]

    @extend_schema(request=JoinSerializer, responses={201: JoinAnswerSerializer})
    def post(self, request: Request) -> Response:
        _check_size(request)
        body = JoinSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        node, raw = services.node_join(
            raw_join_token=data["join_token"],
            host=services.HostFacts(
                hostname=data["hostname"],
                simulated=data["simulated"],
                runtime=data["runtime"],
                ssh_capable=data["ssh"] and data["runtime"] != "process",
                internet_filtered=data["internet_filtered"] and data["runtime"] != "process",
                image_allow=_patterns(data["image_allow"]),
                fabric_address=data["fabric_address"] or _address_or_none(client_ip(request)),
                cluster=data["cluster"],
                interconnect=data["interconnect"],
                interconnect_gbps=data["interconnect_gbps"],
                **data["host"],
            ),
            gpus=[_message(GpuInfo, g) for g in data["gpus"]],
            host_key=data["host_key"],
        )
        # The interval the idle fleet uses now: the agent's first heartbeat follows at once
        # and is stored with it.
        answer = JoinAnswer(
            node_id=node.pk,
            node_token=raw,
            heartbeat_interval_s=services.idle_heartbeat_interval_s(),
        )
        return Response(answer.to_payload(), status=status.HTTP_201_CREATED)


def _patterns(value: list[str] | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


def _address_or_none(text: str) -> str | None:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


class HeartbeatView(APIView):
    """Actual state in, desired state out.

    The token is checked with the heartbeat: a heartbeat with nothing to report but telemetry,
    the common case, is authenticated, marked seen and answered in one statement. A token this
    process has not seen valid in the last VERIFIED_TOKEN_TTL_S is first counted against its
    client address and checked on its own, before the body is read: a forged token costs one
    indexed lookup, never the body's validation, and a new one per request resets no bucket.
    So the token's form is checked first (401), then the token's rate (429), then for an
    unseen token its address's rate (429) and the token (401), then the body (400, or 401 when
    the token was revoked meanwhile), then the token again (401)."""

    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]
    throttle_classes = [NodeThrottle]
    parser_classes = [AgentJSONParser]

    def perform_authentication(self, request: Request) -> None:
        self.raw_token = NodeAuthentication.bearer(request)  # its form only: post() checks it

    def check_permissions(self, request: Request) -> None:
        """A POST's not before its body: post() lets none through without a node's valid token."""
        if request.method != "POST":
            super().check_permissions(request)

    @extend_schema(request=HeartbeatSerializer, responses={200: HeartbeatAnswerSerializer})
    def post(self, request: Request) -> Response:
        digest = token_hash(self.raw_token)
        if not _token_verified_lately(digest):
            # Authenticate before work: a token this process has not seen valid is counted
            # against its address and checked before its body is read.
            throttle = UnverifiedTokenThrottle()
            if not throttle.allow_request(request, self):
                self.throttled(request, throttle.wait())
            if services.node_authenticate(self.raw_token) is None:
                raise exceptions.AuthenticationFailed("invalid or revoked node token")
            _token_verified(digest)
        try:
            _check_size(request)
            body = HeartbeatSerializer.for_data(request.data)
            body.is_valid(raise_exception=True)
        except exceptions.APIException:
            # An unknown token is told so, not what was wrong with its body.
            super().check_permissions(request)
            raise
        data = body.validated_data
        applied = services.node_heartbeat_by_token(
            raw_token=self.raw_token,
            reports=services.HeartbeatReports(
                containers=[_message(ContainerReport, c) for c in data["containers"]],
                usage=[_message(UsageReport, u) for u in data["usage"]],
                metrics=[(str(m["rental_id"]), m["run_id"], m["line"]) for m in data["metrics"]],
                logs=[(m["run_id"], m["line_no"], m["line"]) for m in data["logs"]],
                benchmark=data["benchmark"],
                telemetry=data["telemetry"],
                pulls=[_message(PullProgress, p) for p in data["pulls"]],
                image_allow=_patterns(data["image_allow"]),
                images=None
                if data["images"] is None
                else [_message(CachedImage, i) for i in data["images"]],
                dropped=body.dropped(),
            ),
            desired_digest=data["desired_digest"],
        )
        if applied is None:
            raise exceptions.AuthenticationFailed("invalid or revoked node token")
        node_id, answer = applied
        structlog.contextvars.bind_contextvars(node_id=node_id)
        return Response(answer.to_payload())


class ArtifactUploadsView(APIView):
    """Presigned URLs for files of a rental's output directory (node token; 404 unless the
    run is this rental's on the calling node and the node holds its GPUs)."""

    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]
    throttle_classes = [NodeThrottle]
    parser_classes = [AgentJSONParser]

    @extend_schema(
        request=ArtifactUploadRequestSerializer, responses={200: ArtifactUploadAnswerSerializer}
    )
    def post(self, request: Request, rental_id) -> Response:
        _check_size(request)
        body = ArtifactUploadRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        uploads = services.artifact_uploads_for_node(
            node=request.user,
            rental_id=rental_id,
            run_id=data["run_id"],
            files=[FileSpec(**f) for f in data["files"]],
        )
        answer = ArtifactUploadAnswer(
            uploads=tuple(
                ArtifactUpload(
                    path=u.path,
                    url=u.url,
                    upload_id=u.upload_id,
                    part_urls=u.part_urls,
                    part_size_bytes=u.part_size_bytes,
                    skip=u.skip,
                    expires_at=u.expires_at,
                )
                for u in uploads
            )
        )
        return Response(answer.to_payload())


class ArtifactCommitView(APIView):
    """Record uploaded output files that check out (multipart joined, object there with the
    declared size); the others are answered in `refused` and nothing is recorded for them."""

    authentication_classes = [NodeAuthentication]
    permission_classes = [IsNode]
    throttle_classes = [NodeThrottle]
    parser_classes = [AgentJSONParser]

    @extend_schema(
        request=ArtifactCommitSerializer, responses={200: ArtifactCommitAnswerSerializer}
    )
    def post(self, request: Request, rental_id) -> Response:
        _check_size(request)
        body = ArtifactCommitSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        result = services.artifacts_commit_for_node(
            node=request.user,
            rental_id=rental_id,
            run_id=data["run_id"],
            files=[UploadedFile(**{**f, "etags": tuple(f["etags"])}) for f in data["files"]],
            reason=data["reason"],
        )
        answer = ArtifactCommitAnswer(stored=result.stored, refused=result.refused)
        return Response(answer.to_payload())


class JoinTokenCreateView(APIView):
    """A provider's owner creates a one-time join token for a new host (shown once)."""

    @extend_schema(request=JoinTokenCreateSerializer, responses={201: dict})
    def post(self, request: Request) -> Response:
        body = JoinTokenCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = dict(body.validated_data)
        provider = Provider.objects.filter(owner=request.user, name=data.pop("provider")).first()
        if provider is None:
            raise NotFound("no such provider")
        token, raw = services.join_token_create(provider=provider, created_by=request.user, **data)
        return Response(
            {"join_token": raw, "expires_at": token.expires_at, "region": token.region},
            status=status.HTTP_201_CREATED,
        )


class RentalMetricsView(PaginatedListView):
    """The harness metrics of one of the team's rentals (step, loss, throughput, MFU), in order."""

    @extend_schema(parameters=[RunMetricQuerySerializer], responses=RunMetricSerializer(many=True))
    def get(self, request: Request, rental_id) -> Response:
        if not Rental.objects.filter(pk=rental_id, team=request_team(request)).exists():
            raise NotFound("no such rental")
        query = RunMetricQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        metrics = RunMetric.objects.filter(rental_id=rental_id).order_by("id")
        if event := query.validated_data.get("event"):
            metrics = metrics.filter(event=event)
        if (after := query.validated_data.get("after_step")) is not None:
            metrics = metrics.filter(step__gt=after)
        return self.paginated(metrics.values("data", "received_at"), RunMetricSerializer)


class RentalLogsView(PaginatedListView):
    """The output of one of the team's rentals' containers, oldest first: `?after=ID` gives the
    lines after the last one you have (follow), `?tail=N` the last N.

    A run that ended before the agent forwarded a line (it failed to start, or exited at
    once), or whose lines have expired, has no live log; its output is then the log tail its
    agent reported when the run ended (the one `show` prints), numbered from 1."""

    @extend_schema(parameters=[RunLogQuerySerializer], responses=RunLogLineSerializer(many=True))
    def get(self, request: Request, rental_id) -> Response:
        rental = (
            Rental.objects.filter(pk=rental_id, team=request_team(request))
            .only("status", "log_tail", "ended_at")
            .first()
        )
        if rental is None:
            raise NotFound("no such rental")
        query = RunLogQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        lines = RunLogLine.objects.filter(rental_id=rental_id)
        if rental.status in TERMINAL and not lines.exists():
            return self.paginated(_ended_tail(rental, **query.validated_data), RunLogLineSerializer)
        if (after := query.validated_data.get("after")) is not None:
            lines = lines.filter(id__gt=after)
        if tail := query.validated_data.get("tail"):
            last = list(lines.order_by("-id").values_list("id", flat=True)[tail - 1 : tail])
            if last:
                lines = lines.filter(id__gte=last[0])
        fields = ("id", "run_id", "line_no", "line", "received_at")
        return self.paginated(lines.order_by("id").values(*fields), RunLogLineSerializer)


def _ended_tail(rental: Rental, *, after: int | None = None, tail: int | None = None) -> list:
    """An ended rental's output from the log tails of its runs (the rental's own when no run
    kept one), as live-log rows: ids from 1 in order, so `after` and `tail` read as they do."""
    runs = ContainerRun.objects.filter(rental=rental).exclude(log_tail="")
    tails = [
        (run.run_id, run.log_tail, run.last_report_at or rental.ended_at)
        for run in runs.order_by("created_at", "pk").only("run_id", "log_tail", "last_report_at")
    ] or [("", rental.log_tail, rental.ended_at)]
    rows = [
        {"run_id": run_id, "line_no": line_no, "line": line, "received_at": at}
        for run_id, text, at in tails
        for line_no, line in enumerate(text.splitlines())
    ]
    for number, row in enumerate(rows, start=1):
        row["id"] = number
    rows = rows[after:] if after is not None else rows
    return rows[-tail:] if tail else rows
