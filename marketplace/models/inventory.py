"""Inventory: the GPU servers providers list, their GPUs, and the ops actions taken on them."""

from decimal import Decimal

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import F, Q, Value


class NodeStatus(models.TextChoices):
    ONLINE = "online", "Online"
    OFFLINE = "offline", "Offline"
    MAINTENANCE = "maintenance", "Maintenance"
    DRAINING = "draining", "Draining"


class Interconnect(models.TextChoices):
    """The fabric that joins the nodes of a cluster, as providers name it."""

    INFINIBAND = "infiniband", "InfiniBand"
    ROCE = "roce", "RoCE (RDMA over Ethernet)"
    ETHERNET = "ethernet", "Ethernet"
    NVLINK = "nvlink", "NVLink Switch"


def interconnect_label(kind: str, gbps: int) -> str:
    """What customers read: "InfiniBand 400 Gb/s"."""
    return f"{_INTERCONNECT_NAMES.get(kind, kind)} {gbps} Gb/s"


# Each fabric's short name ("RoCE"), looked up once: the advisor labels every offer it reads.
_INTERCONNECT_NAMES = {kind.value: kind.label.split(" (")[0] for kind in Interconnect}


# A cluster's declared bandwidth per node, in Gb/s: from one 1 GbE port to an NVLink Switch
# tray of four GPUs at 1.8 TB/s each (57,600 Gb/s, GB200 NVL72), with room to spare.
CLUSTER_GBPS_MAX = 64_000


class Cluster(models.Model):
    """Nodes of one provider that share a fabric: where a multi-node rental may be placed."""

    provider = models.ForeignKey(
        "marketplace.Provider", on_delete=models.CASCADE, related_name="clusters"
    )
    name = models.SlugField(max_length=40, help_text="unique per provider, e.g. h100-ib")
    interconnect = models.CharField(max_length=12, choices=Interconnect.choices)
    bandwidth_gbps = models.PositiveIntegerField(
        help_text="the fabric's bandwidth per node, Gb/s (e.g. 400 for one NDR port)"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["provider_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["provider", "name"], name="cluster_unique_name"),
            # What the composite key of node (cluster, provider) references: a node joins only a
            # cluster of its own provider (migration 0021).
            models.UniqueConstraint(fields=["id", "provider"], name="cluster_id_provider"),
            models.CheckConstraint(
                condition=Q(bandwidth_gbps__gt=0) & Q(bandwidth_gbps__lte=CLUSTER_GBPS_MAX),
                name="cluster_bandwidth_bounded",
            ),
            models.CheckConstraint(
                condition=Q(interconnect__in=Interconnect.values),
                name="cluster_interconnect_known",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def interconnect_label(self) -> str:
        return interconnect_label(self.interconnect, self.bandwidth_gbps)


class GpuHealth(models.TextChoices):
    """A GPU's state as its health signals tell: FAILED is out of placement until a passing
    check; DEGRADED still rents, shown and ranked down."""

    OK = "ok", "OK"
    DEGRADED = "degraded", "Degraded"
    FAILED = "failed", "Failed"


class Node(models.Model):
    """A GPU server of a provider: where rentals run, priced per GPU-hour."""

    provider = models.ForeignKey(
        "marketplace.Provider", on_delete=models.PROTECT, related_name="nodes"
    )
    hostname = models.CharField(max_length=253)
    region = models.SlugField(max_length=40, help_text="e.g. eu-west, us-east")
    pool = models.SlugField(max_length=40, default="default", help_text="scheduler shard")
    cpu_cores = models.PositiveIntegerField()
    ram_gb = models.PositiveIntegerField()
    disk_gb = models.PositiveIntegerField()
    net_up_mbps = models.PositiveIntegerField(default=0)
    net_down_mbps = models.PositiveIntegerField(default=0)
    driver_version = models.CharField(max_length=40, blank=True)
    cuda_version = models.CharField(max_length=20, blank=True)
    # A listing is homogeneous ("8x H100 SXM5"), as on every GPU marketplace; keeping the card
    # and the count on the node lets the offers query read 10,000 nodes instead of 80,000 GPUs.
    gpu_model = models.ForeignKey(
        "marketplace.GpuModel", on_delete=models.PROTECT, related_name="nodes"
    )
    gpu_count = models.PositiveSmallIntegerField()
    nvlink = models.BooleanField(
        default=False, help_text="GPUs of one topology group are connected by NVLink"
    )
    status = models.CharField(max_length=12, choices=NodeStatus.choices, default=NodeStatus.OFFLINE)
    # Measured from history by provisioning's reliability pass; what the provider declared is
    # only its prior, which a new node shows until it has hours of record.
    reliability = models.DecimalField(
        max_digits=5, decimal_places=4, default=Decimal("0.9500"), help_text="0 to 1, measured"
    )
    reliability_declared = models.DecimalField(
        max_digits=5, decimal_places=4, default=Decimal("0.9500"), help_text="the prior, 0 to 1"
    )
    reliability_observed_hours = models.FloatField(
        default=0, help_text="listed hours behind the measured reliability (last 30 days)"
    )
    simulated = models.BooleanField(
        default=False, help_text="GPUs and telemetry are simulated: no real NVIDIA hardware"
    )
    # What the node's agent can run, as it said at its (re)join: the local-process runtime has
    # no container, so no sshd and no published port. Nodes that joined before agents said so
    # keep True, the behaviour they had.
    runtime = models.CharField(
        max_length=12, blank=True, help_text="docker or process, as the agent said at join"
    )
    ssh_capable = models.BooleanField(
        default=True, help_text="the agent can run an sshd in a rental and publish its port"
    )
    # Whether a rental with the internet may be placed here (Rental.network), derived at each
    # (re)join by `node_register` / `node_join` from what the agent said: its packet filter
    # keeps rentals to the public internet (`internet_filtered`), or it is a simulated node on
    # the local-process runtime, a development runtime on the host's own network with no
    # isolation at all (docs/manual: Networking). Nodes that never said are not capable.
    internet_filtered = models.BooleanField(
        default=False,
        db_default=False,
        help_text="the agent filters a rental's internet to public addresses",
    )
    internet_capable = models.BooleanField(
        default=False, db_default=False, help_text="rentals with internet may be placed here"
    )
    # The images its agent accepts (allow-list patterns, agentprotocol.images), as the agent said
    # at join or in a heartbeat; None: never said (agents that predate it), any image. The
    # scheduler never places a rental whose image the node would refuse.
    image_allow = ArrayField(
        models.CharField(max_length=255),
        null=True,
        blank=True,
        help_text="image patterns the agent accepts; empty: none, unset: any",
    )
    # The images the agent holds in its cache, as it last reported them (only when they change):
    # [{"ref": "repo:tag", "digest": "sha256:..", "size_bytes": n}]. A node holding a rental's
    # image is preferred among otherwise equal ones: no pull before the start.
    # Defaults in the database too: bulk loaders (bench/, COPY) that name older columns only.
    images = models.JSONField(
        default=list, db_default=Value([], output_field=models.JSONField()), blank=True
    )
    # Where the other members of a multi-node rental reach this node's runs (the rendezvous
    # store, gloo/NCCL): declared by the agent at join, else the address the join came from.
    fabric_address = models.GenericIPAddressField(
        null=True, blank=True, help_text="the address the members of a multi-node rental use"
    )
    # The fabric it shares with other nodes of its provider; only clustered nodes host the
    # members of a multi-node rental, all of them in one cluster.
    cluster = models.ForeignKey(
        Cluster, null=True, blank=True, on_delete=models.SET_NULL, related_name="nodes"
    )
    price_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)
    min_bid_per_gpu_hour = models.DecimalField(max_digits=10, decimal_places=4)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    # The heartbeat interval its last answer asked for when longer than HEARTBEAT_INTERVAL_S
    # (an idle node of a large fleet, provisioning.services.heartbeat), else 0: the node is
    # silent only once it has missed three of them (`silence_timeout_s`).
    heartbeat_interval_s = models.PositiveIntegerField(default=0, db_default=0)
    # The latest measured dense matmul TFLOPS (harness benchmark), kept here for the listing;
    # the history is in provisioning.NodeBenchmark.
    measured_tflops = models.FloatField(null=True, blank=True)
    benchmark_requested = models.BooleanField(default=False)
    # The latest benchmark fell below its card's plausible band: shown, and ranked down.
    # Defaults in the database too: bulk loaders (bench/, COPY) that name older columns only.
    benchmark_below_band = models.BooleanField(
        default=False, db_default=False, help_text="the latest benchmark fell below the card's band"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.UniqueConstraint(fields=["provider", "hostname"], name="node_unique_hostname"),
            models.CheckConstraint(
                condition=Q(price_per_gpu_hour__gt=0), name="node_price_positive"
            ),
            models.CheckConstraint(
                condition=Q(min_bid_per_gpu_hour__gt=0)
                & Q(min_bid_per_gpu_hour__lte=F("price_per_gpu_hour")),
                name="node_min_bid_within_price",
            ),
            models.CheckConstraint(
                condition=Q(reliability__gte=0) & Q(reliability__lte=1),
                name="node_reliability_unit_interval",
            ),
            models.CheckConstraint(
                condition=Q(cpu_cores__gt=0) & Q(ram_gb__gt=0) & Q(gpu_count__gt=0),
                name="node_resources_positive",
            ),
        ]
        indexes = [
            models.Index(fields=["status", "region"], name="node_status_region"),
            # A create's feasibility check reads a pool's cheapest few nodes: an index walk,
            # not a sort of the whole pool.
            models.Index(fields=["pool", "price_per_gpu_hour", "id"], name="node_pool_cheapest"),
        ]

    def __str__(self) -> str:
        return self.hostname

    def silence_timeout_s(self) -> int:
        """How long its agent may be silent before the node is taken for lost."""
        return silence_timeout_s(self.heartbeat_interval_s)


def silence_timeout_s(heartbeat_interval_s: int) -> int:
    """NODE_SILENCE_TIMEOUT_S, or three of the intervals a node was asked to heartbeat at."""
    return max(settings.GPUMARKET["NODE_SILENCE_TIMEOUT_S"], 3 * heartbeat_interval_s)


class Gpu(models.Model):
    """One physical GPU in a node; the unit the scheduler allocates."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(help_text="the host's device index (nvidia-smi)")
    uuid = models.CharField(max_length=64, unique=True)
    model = models.ForeignKey("marketplace.GpuModel", on_delete=models.PROTECT, related_name="gpus")
    topology_group = models.CharField(
        max_length=40,
        blank=True,
        help_text="GPUs that share an NVLink island or a PCIe switch have the same group",
    )
    health = models.CharField(
        max_length=10, choices=GpuHealth.choices, default=GpuHealth.OK, db_default=GpuHealth.OK
    )
    health_reason = models.CharField(max_length=200, blank=True, default="", db_default="")
    health_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node_id", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node"),
        ]

    def __str__(self) -> str:
        return f"{self.node.hostname}/gpu{self.index}"


class GpuHealthEvent(models.Model):
    """An audit row for each health change of a GPU: the history behind its state, the
    provider's page and the node's reliability."""

    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="health_events")
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpu_health_events")
    from_health = models.CharField(max_length=10, choices=GpuHealth.choices)
    to_health = models.CharField(max_length=10, choices=GpuHealth.choices)
    reason = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["node", "created_at"], name="gpuhealth_node_created")]

    def __str__(self) -> str:
        return f"{self.gpu_id}: {self.from_health} -> {self.to_health}"


class NodeEvent(models.Model):
    """An audit row for each status change of a node: who, when, from, to, and why."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="events")
    from_status = models.CharField(max_length=12, choices=NodeStatus.choices)
    to_status = models.CharField(max_length=12, choices=NodeStatus.choices)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    reason = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.node_id}: {self.from_status} -> {self.to_status}"
