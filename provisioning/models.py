"""Provisioning state on the server: how agents join and authenticate, what runs where."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q


class JoinToken(models.Model):
    """A one-time token a provider gives a new host's agent, carrying the listing terms."""

    provider = models.ForeignKey(
        "marketplace.Provider", on_delete=models.CASCADE, related_name="join_tokens"
    )
    key_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16)
    region = models.SlugField(max_length=40)
    pool = models.SlugField(max_length=40, default="default")
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)
    min_bid_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    # The node it joined; a host that lost its token joins its node again with a new one.
    node = models.ForeignKey(
        "marketplace.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Hash of the secret the joining host sent with it: the same host may repeat a join whose
    # answer it never received (a timeout after the server committed) and gets its node back.
    host_key_hash = models.CharField(max_length=64, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(price_per_gpu_hour__gt=0) & Q(min_bid_per_gpu_hour__gt=0),
                name="jointoken_prices_positive",
            )
        ]

    def __str__(self) -> str:
        return f"join {self.prefix}… for {self.provider_id}"


class NodeCredential(models.Model):
    """The node token an agent authenticates with; only its SHA-256 is stored."""

    node = models.ForeignKey(
        "marketplace.Node", on_delete=models.CASCADE, related_name="credentials"
    )
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["node"], condition=Q(revoked_at__isnull=True), name="one_live_credential"
            )
        ]

    def __str__(self) -> str:
        return f"credential of node {self.node_id}"


class ContainerRun(models.Model):
    """One container run of a rental on one node, as its agent last reported it."""

    class Status(models.TextChoices):
        REQUESTED = "requested", "Requested"
        CREATED = "created", "Created"
        RUNNING = "running", "Running"
        EXITED = "exited", "Exited"
        MISSING = "missing", "Missing"

    rental = models.ForeignKey("marketplace.Rental", on_delete=models.CASCADE, related_name="runs")
    node = models.ForeignKey("marketplace.Node", on_delete=models.CASCADE, related_name="runs")
    run_id = models.CharField(max_length=128, unique=True)
    # A member of a multi-node rental: its node rank (NODE_RANK) in its placement; None alone.
    node_rank = models.PositiveSmallIntegerField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.REQUESTED)
    exit_code = models.IntegerField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    log_tail = models.TextField(blank=True)
    # The ports the agent publishes while the run runs: [{container_port, host, host_port}].
    published = models.JSONField(default=list, blank=True)
    # While its image is pulled before the start: {"done_bytes", "total_bytes", "at"} (epoch
    # seconds of the report), as the agent last reported it; null when no pull was reported.
    pull_progress = models.JSONField(null=True, blank=True)
    last_report_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["rental", "node"], name="one_run_per_rental_node")
        ]

    def __str__(self) -> str:
        return self.run_id


class RunMetric(models.Model):
    """A JSON-lines metric the harness printed, forwarded by the agent (step, loss, ...)."""

    rental = models.ForeignKey(
        "marketplace.Rental", on_delete=models.CASCADE, related_name="metrics"
    )
    run_id = models.CharField(max_length=128)
    # A replayed line (agent restart, retried heartbeat) hashes the same: stored once.
    line_hash = models.CharField(max_length=40)
    event = models.CharField(max_length=20, blank=True)
    step = models.IntegerField(null=True, blank=True)
    data = models.JSONField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run_id", "line_hash"], name="metric_once")]
        indexes = [models.Index(fields=["rental", "step"], name="metric_by_rental")]

    def __str__(self) -> str:
        return f"{self.run_id} {self.event} {self.step}"


class RunLogLine(models.Model):
    """One line of a run's output, for the live log (`gpumarket logs -f`, the rental page).

    `line_no` is the line's index in the run's output as the agent numbered it: a line sent
    again after an agent restart or a retried heartbeat is kept once. Kept LOG_RETENTION_DAYS."""

    id = models.BigAutoField(primary_key=True)
    rental = models.ForeignKey(
        "marketplace.Rental", on_delete=models.CASCADE, related_name="log_lines", db_index=False
    )
    run_id = models.CharField(max_length=128)
    line_no = models.BigIntegerField()
    line = models.TextField()
    received_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run_id", "line_no"], name="log_line_once"),
        ]
        indexes = [
            models.Index(fields=["rental", "id"], name="log_by_rental"),
            models.Index(fields=["received_at"], name="log_by_age"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.line_no}"


class NodeBenchmark(models.Model):
    """A measured benchmark of a node's GPU (the harness's benchmark mode), not its claims."""

    node = models.ForeignKey(
        "marketplace.Node", on_delete=models.CASCADE, related_name="benchmarks"
    )
    measured_at = models.DateTimeField(auto_now_add=True)
    precision = models.CharField(max_length=8)
    device_name = models.CharField(max_length=120, blank=True)
    matmul_tflops = models.FloatField()
    mem_bandwidth_gbs = models.FloatField(null=True, blank=True)
    h2d_gbs = models.FloatField(null=True, blank=True)
    train_samples_per_s = models.FloatField(null=True, blank=True)
    raw = models.JSONField()
    # Within the band marketplace.selectors.measured_tflops_plausible allows for the node's card;
    # an implausible result is kept for the record and never priced.
    plausible = models.BooleanField(default=True)

    class Meta:
        ordering = ["-measured_at"]
        constraints = [
            models.CheckConstraint(condition=Q(matmul_tflops__gt=0), name="benchmark_positive")
        ]

    def __str__(self) -> str:
        return f"{self.node_id}: {self.matmul_tflops:.1f} TFLOPS {self.precision}"
