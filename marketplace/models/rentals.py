"""Rentals: what a customer asked for, its life as a state machine, and the GPUs bound to it."""

import uuid

from django.conf import settings
from django.contrib.postgres.constraints import ExclusionConstraint
from django.contrib.postgres.fields import ArrayField, DateTimeRangeField, RangeOperators
from django.db import models
from django.db.models import Q, Value


class RentalStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SCHEDULED = "scheduled", "Scheduled"
    PROVISIONING = "provisioning", "Provisioning"
    RUNNING = "running", "Running"
    STOPPING = "stopping", "Stopping"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    PREEMPTED = "preempted", "Preempted"
    EXPIRED = "expired", "Expired"


class RentalKind(models.TextChoices):
    ON_DEMAND = "on_demand", "On-demand"
    INTERRUPTIBLE = "interruptible", "Interruptible"


class RentalNetwork(models.TextChoices):
    """What a rental's containers reach: the public internet and nothing else (NAT, the LAN,
    private ranges, metadata addresses, the host and other tenants filtered by the node), or
    nothing outside the rental. The wire's agentprotocol.Network, with labels."""

    INTERNET = "internet", "Internet"
    INTERNAL = "internal", "Internal (no network)"


class EndCause(models.TextChoices):
    """Whose doing a rental's ending (or a re-queue) was: only NODE counts against the node's
    measured reliability, and only NODE is credited to the customer."""

    CUSTOMER = "customer", "Customer"
    NODE = "node", "Node"
    PLATFORM = "platform", "Platform"
    PREEMPTION = "preemption", "Preemption"


class PreemptionPolicy(models.TextChoices):
    """What becomes of an interruptible rental whose GPUs are taken for another."""

    REQUEUE = "requeue", "Re-queue and resume from the last checkpoint"
    END = "end", "End as preempted"


class Rental(models.Model):
    """A customer's request for GPUs and, once placed, the booking that runs and is billed."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Who asked for it; the team owns it (sees it, pays for it, may stop it).
    customer = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="rentals"
    )
    team = models.ForeignKey("accounts.Team", on_delete=models.PROTECT, related_name="rentals")
    name = models.CharField(max_length=80, blank=True)
    status = models.CharField(
        max_length=12, choices=RentalStatus.choices, default=RentalStatus.PENDING
    )
    status_reason = models.CharField(max_length=500, blank=True)

    # What was asked for.
    gpu_models = ArrayField(models.SlugField(max_length=40), default=list, blank=True)
    gpu_families = ArrayField(models.SlugField(max_length=20), default=list, blank=True)
    min_memory_gb = models.PositiveIntegerField(default=0)
    min_tensor_tflops = models.DecimalField(max_digits=7, decimal_places=2, default=0)
    gpus_per_node = models.PositiveSmallIntegerField()
    node_count = models.PositiveSmallIntegerField(default=1)
    same_group = models.BooleanField(
        default=False, help_text="all GPUs of a node in one NVLink / PCIe-switch group"
    )
    region = models.SlugField(max_length=40, blank=True)
    pool = models.SlugField(max_length=40, default="default")
    # A gang: only a cluster whose fabric is at least this fast (what an advisor plan was
    # priced with); 0: any cluster.
    min_interconnect_gbps = models.PositiveIntegerField(
        default=0, db_default=0, help_text="a multi-node rental's least cluster bandwidth, Gb/s"
    )
    max_price_per_gpu_hour = models.DecimalField(
        max_digits=10, decimal_places=4, null=True, blank=True
    )
    kind = models.CharField(max_length=14, choices=RentalKind.choices, default=RentalKind.ON_DEMAND)
    # Chosen at create (settings.GPUMARKET["PREEMPTION_POLICY"] unless the customer chose).
    preemption_policy = models.CharField(
        max_length=8,
        choices=PreemptionPolicy.choices,
        default=PreemptionPolicy.END,
        db_default=PreemptionPolicy.END,
    )
    bid_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4, null=True, blank=True)
    priority = models.SmallIntegerField(default=0)
    start_at = models.DateTimeField(help_text="earliest start")
    start_deadline = models.DateTimeField(help_text="latest acceptable start; then EXPIRED")
    duration_s = models.PositiveIntegerField()

    # What runs.
    image = models.CharField(max_length=255)
    command = models.JSONField(default=list, blank=True)
    harness_config = models.JSONField(null=True, blank=True)
    env = models.JSONField(default=dict, blank=True)
    ports = ArrayField(models.PositiveIntegerField(), default=list, blank=True)
    # Start from this earlier rental's last synced checkpoint (one of the same customer's).
    resume_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # An sshd in the container for the customer's SSH keys (accounts.models.sshkeys).
    ssh = models.BooleanField(default=False)
    # Placed only on nodes that can enforce it (Node.internet_capable) when INTERNET.
    network = models.CharField(
        max_length=10,
        choices=RentalNetwork.choices,
        default=RentalNetwork.INTERNET,
        db_default=RentalNetwork.INTERNET,
    )
    # The team secrets the run gets, by name only ([{"name", "env", "file"}]: the values stay
    # encrypted in accounts.TeamSecret until the spec for the node is built).
    # Defaults in the database too: bulk loaders (bench/, COPY) that name older columns only.
    secrets = models.JSONField(
        default=list, db_default=Value([], output_field=models.JSONField()), blank=True
    )
    # A team secret holding the credentials the image is pulled with ("": none).
    registry_secret = models.CharField(max_length=64, blank=True, default="", db_default="")
    # JupyterLab beside the command (nodeagent/runtime/jupyter.py), on JUPYTER_PORT, with this
    # token: made by the server, a per-rental value shown only to the rental's team.
    jupyter = models.BooleanField(default=False, db_default=False)
    jupyter_token = models.CharField(max_length=64, blank=True, default="", db_default="")

    # What happened.
    price_per_gpu_hour = models.DecimalField(
        max_digits=10, decimal_places=4, null=True, blank=True, help_text="locked at booking"
    )
    scheduled_start = models.DateTimeField(null=True, blank=True)
    scheduled_end = models.DateTimeField(null=True, blank=True)
    # The server's own clock: when it recorded the RUNNING event and the end. What the agent
    # reported is kept on its container run (provisioning.ContainerRun), shown as reported.
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    end_cause = models.CharField(max_length=10, choices=EndCause.choices, blank=True, db_default="")
    exit_code = models.IntegerField(null=True, blank=True)
    log_tail = models.TextField(blank=True)
    # The advisor's plan when it booked this rental: compared with the run's measured metrics.
    advisor_estimate = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(gpus_per_node__gte=1) & Q(node_count__gte=1), name="rental_sizes"
            ),
            models.CheckConstraint(
                condition=Q(kind="on_demand", bid_per_gpu_hour__isnull=True)
                | Q(kind="interruptible", bid_per_gpu_hour__gt=0),
                name="rental_bid_iff_interruptible",
            ),
            models.CheckConstraint(
                condition=Q(start_deadline__gte=models.F("start_at")), name="rental_deadline"
            ),
            models.CheckConstraint(condition=Q(duration_s__gt=0), name="rental_duration"),
            models.CheckConstraint(
                condition=Q(network__in=RentalNetwork.values), name="rental_network_known"
            ),
        ]
        indexes = [
            models.Index(fields=["status", "pool", "created_at"], name="rental_queue"),
            models.Index(fields=["customer", "-created_at"], name="rental_by_customer"),
            models.Index(fields=["team", "-created_at"], name="rental_by_team"),
        ]

    def __str__(self) -> str:
        return f"{self.name or 'rental'} {self.id}"

    @property
    def gpu_count(self) -> int:
        return self.gpus_per_node * self.node_count


class RentalEvent(models.Model):
    """One state change of a rental (or a notable fact about it): time, actor, reason."""

    class Actor(models.TextChoices):
        CUSTOMER = "customer", "Customer"
        SCHEDULER = "scheduler", "Scheduler"
        AGENT = "agent", "Node agent"
        OPS = "ops", "Ops staff"
        BILLING = "billing", "Billing"
        SYSTEM = "system", "System"

    rental = models.ForeignKey(Rental, on_delete=models.CASCADE, related_name="events")
    from_status = models.CharField(max_length=12, choices=RentalStatus.choices, blank=True)
    to_status = models.CharField(max_length=12, choices=RentalStatus.choices)
    actor_kind = models.CharField(max_length=10, choices=Actor.choices)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    reason = models.CharField(max_length=500, blank=True)
    # Whose doing an ending or a re-queue was; blank for every other move.
    cause = models.CharField(max_length=10, choices=EndCause.choices, blank=True, db_default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"{self.rental_id}: {self.from_status or '-'} -> {self.to_status}"


class RentalCredit(models.Model):
    """GPU time a node fault destroyed, credited automatically: the span from the rental's last
    synced checkpoint (its whole run when it never checkpointed) to the fault. The billing pass
    bills none of it to the customer and pays none of it to the provider."""

    rental = models.ForeignKey(Rental, on_delete=models.PROTECT, related_name="credits")
    # The node blamed, by name: what the customer is shown.
    hostname = models.CharField(max_length=255)
    reason = models.CharField(max_length=500)
    during = DateTimeRangeField()
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return f"credit {self.rental_id} {self.during}"


class Allocation(models.Model):
    """One GPU bound to one rental for a time range; the database forbids overlaps per GPU."""

    rental = models.ForeignKey(Rental, on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey("marketplace.Gpu", on_delete=models.PROTECT, related_name="allocations")
    node = models.ForeignKey(
        "marketplace.Node", on_delete=models.PROTECT, related_name="allocations"
    )
    during = DateTimeRangeField()
    released_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            # The invariant itself: whatever the code does, one GPU is never in two active
            # allocations whose time ranges overlap.
            ExclusionConstraint(
                name="allocation_no_double_booking",
                expressions=[("gpu", RangeOperators.EQUAL), ("during", RangeOperators.OVERLAPS)],
                condition=Q(released_at__isnull=True),
                index_type="gist",
            ),
            models.UniqueConstraint(
                fields=["rental", "gpu"],
                condition=Q(released_at__isnull=True),
                name="allocation_once_per_gpu",
            ),
        ]
        indexes = [
            models.Index(
                fields=["node"],
                condition=Q(released_at__isnull=True),
                name="allocation_active_node",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.rental_id} gpu {self.gpu_id} {self.during}"
