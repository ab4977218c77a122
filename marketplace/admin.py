"""The ops console: people, inventory, catalog and rentals (staff only, as the admin always is).
Teams and tokens are in accounts.admin."""

from __future__ import annotations

from collections import Counter

from django import forms
from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin
from django.db.models import Prefetch

from accounts.models import Membership
from accounts.services import team_personal_ensure
from core.errors import DomainError
from marketplace import services
from marketplace.models import (
    Allocation,
    Cluster,
    Gpu,
    GpuHealth,
    GpuHealthEvent,
    GpuModel,
    Node,
    NodeEvent,
    Provider,
    Rental,
    RentalEvent,
    RentalTemplate,
    User,
)


class UserMembershipInline(admin.TabularInline):
    model = Membership
    fields = ["team", "role", "created_at"]
    readonly_fields = ["created_at"]
    raw_id_fields = ["team"]
    extra = 0


@admin.register(User)
class MarketplaceUserAdmin(UserAdmin):
    inlines = [UserMembershipInline]

    def save_model(self, request, obj, form, change) -> None:
        super().save_model(request, obj, form, change)
        if not change:
            # Every person has a personal team, however their account was made.
            team_personal_ensure(user=obj)


@admin.register(Provider)
class ProviderAdmin(admin.ModelAdmin):
    list_display = ["name", "owner", "is_platform", "created_at"]
    search_fields = ["name", "owner__username"]
    list_select_related = ["owner"]


@admin.register(GpuModel)
class GpuModelAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "family",
        "tier",
        "memory_gb",
        "memory_bandwidth_gbs",
        "tensor_tflops",
        "fp32_tflops",
        "bf16",
        "nvlink_gbs",
        "tdp_w",
        "figures_checked",
    ]
    list_filter = ["tier", "family", "bf16", "figures_checked"]
    search_fields = ["name", "slug", "family"]
    prepopulated_fields = {"slug": ["name"]}


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "uuid", "model", "topology_group", "health", "health_reason", "health_since"]
    # Health changes come from heartbeats and checks only (provisioning's health), never by hand:
    # a FAILED GPU returns through a passing check ("Benchmark again" below).
    readonly_fields = ["health", "health_reason", "health_since"]
    autocomplete_fields = ["model"]


class NodeEventInline(admin.TabularInline):
    model = NodeEvent
    extra = 0
    can_delete = False
    fields = ["created_at", "from_status", "to_status", "actor", "reason"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


def _node_action(action: str, label: str):
    def run(modeladmin, request, queryset):
        done, refused = 0, []
        for node_id, hostname in queryset.order_by("pk").values_list("pk", "hostname"):
            try:
                services.node_set_status(
                    node_id=node_id, action=action, actor=request.user, reason=f"admin: {label}"
                )
                done += 1
            except DomainError as exc:
                refused.append(f"{hostname}: {exc.message}")
        if done:
            modeladmin.message_user(request, f"{label}: {done} node(s)", messages.SUCCESS)
        if refused:
            modeladmin.message_user(request, "; ".join(refused), messages.WARNING)

    run.__name__ = f"node_{action}"
    run.short_description = label  # type: ignore[attr-defined]
    return run


class ClusterNodeInline(admin.TabularInline):
    model = Node
    fk_name = "cluster"
    extra = 0
    can_delete = False
    fields = ["hostname", "region", "status", "gpu_count"]
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = ["name", "provider", "interconnect", "bandwidth_gbps", "node_count"]
    list_filter = ["interconnect", "provider"]
    search_fields = ["name", "provider__name"]
    list_select_related = ["provider"]
    inlines = [ClusterNodeInline]

    @admin.display(description="nodes")
    def node_count(self, obj: Cluster) -> int:
        return obj.nodes.count()


class NodeAdminForm(forms.ModelForm):
    class Meta:
        model = Node
        fields = "__all__"  # noqa: DJ007 - the admin edits every column

    def clean(self):
        data = super().clean()
        cluster, provider = data.get("cluster"), data.get("provider")
        if cluster is not None and provider is not None and cluster.provider_id != provider.pk:
            raise forms.ValidationError({"cluster": "a cluster of the node's own provider"})
        return data


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    form = NodeAdminForm
    list_display = [
        "hostname",
        "provider",
        "region",
        "cluster",
        "status",
        "gpu_summary",
        "measured_tflops",
        "benchmark_below_band",
        "price_per_gpu_hour",
        "reliability",
        "simulated",
        "last_seen_at",
    ]
    list_filter = [
        "status", "region", "simulated", "nvlink", "benchmark_below_band", "gpus__health",
        "provider",
    ]  # fmt: skip
    search_fields = ["hostname"]
    list_select_related = ["provider", "cluster"]
    inlines = [GpuInline, NodeEventInline]
    readonly_fields = ["status", "last_seen_at", "created_at"]
    actions = [
        _node_action("drain", "Drain (no new rentals)"),
        _node_action("maintenance", "Put in maintenance"),
        _node_action("online", "Bring back online"),
        "request_benchmark",
    ]

    @admin.action(
        description="Benchmark again: the platform's check, on the node's failed GPUs if any "
        "(a failed GPU that passes it with clean readings is back in placement)"
    )
    def request_benchmark(self, request, queryset):
        ids = list(queryset.values_list("pk", flat=True))
        for node_id in ids:
            services.node_request_benchmark(node_id=node_id)
        self.message_user(request, f"benchmark requested on {len(ids)} node(s)", messages.SUCCESS)

    @admin.display(description="GPUs")
    def gpu_summary(self, obj: Node) -> str:
        gpus = obj.gpus.all()
        counts = Counter(gpu.model.name for gpu in gpus)
        summary = ", ".join(f"{n}x {name}" for name, n in sorted(counts.items()))
        unhealthy = [f"GPU {g.index} {g.health}" for g in gpus if g.health != GpuHealth.OK]
        return f"{summary} ({', '.join(unhealthy)})" if unhealthy else summary

    def get_queryset(self, request):
        gpus = Gpu.objects.select_related("model")
        return super().get_queryset(request).prefetch_related(Prefetch("gpus", queryset=gpus))


@admin.register(GpuHealthEvent)
class GpuHealthEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "node", "gpu", "from_health", "to_health", "reason"]
    list_filter = ["to_health"]
    list_select_related = ["node", "gpu__node"]
    search_fields = ["node__hostname", "reason"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(NodeEvent)
class NodeEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "node", "from_status", "to_status", "actor", "reason"]
    list_filter = ["to_status"]
    list_select_related = ["node", "actor"]
    search_fields = ["node__hostname", "reason"]

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_add_permission(self, request) -> bool:
        return False


class RentalEventInline(admin.TabularInline):
    model = RentalEvent
    extra = 0
    can_delete = False
    fields = ["created_at", "from_status", "to_status", "actor_kind", "actor", "reason"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Rental)
class RentalAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "team",
        "customer",
        "status",
        "gpus_per_node",
        "node_count",
        "kind",
        "created_at",
    ]
    list_filter = ["status", "kind"]
    search_fields = ["id", "customer__username", "team__name", "name"]
    list_select_related = ["customer", "team"]
    inlines = [RentalEventInline]
    readonly_fields = ["status", "status_reason", "price_per_gpu_hour", "created_at", "updated_at"]
    raw_id_fields = ["resume_from"]


@admin.register(Allocation)
class AllocationAdmin(admin.ModelAdmin):
    list_display = ["rental", "node", "gpu", "during", "released_at"]
    list_select_related = ["rental", "node", "gpu__node"]
    search_fields = ["rental__id", "node__hostname"]


@admin.register(RentalTemplate)
class RentalTemplateAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "image", "created_by", "updated_at"]
    list_select_related = ["team", "created_by"]
    search_fields = ["name", "image", "team__name"]
    raw_id_fields = ["team", "created_by"]
