"""Ops views of provisioning: join tokens, node credentials, container runs, benchmarks."""

from __future__ import annotations

from django.contrib import admin, messages

from provisioning import services
from provisioning.models import ContainerRun, JoinToken, NodeBenchmark, NodeCredential, RunMetric


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(JoinToken)
class JoinTokenAdmin(ReadOnlyAdmin):
    list_display = ["prefix", "provider", "region", "price_per_gpu_hour", "expires_at", "used_at"]
    list_select_related = ["provider"]


@admin.register(NodeCredential)
class NodeCredentialAdmin(ReadOnlyAdmin):
    list_display = ["node", "created_at", "revoked_at"]
    list_select_related = ["node"]
    actions = ["revoke"]

    @admin.action(description="Revoke (the agent gets 401)")
    def revoke(self, request, queryset):
        count = sum(
            services.node_credential_revoke(node_id=node_id, actor=request.user)
            for node_id in queryset.values_list("node_id", flat=True).distinct()
        )
        self.message_user(request, f"revoked {count} credential(s)", messages.SUCCESS)


@admin.register(ContainerRun)
class ContainerRunAdmin(ReadOnlyAdmin):
    list_display = ["run_id", "node", "rental", "status", "exit_code", "last_report_at"]
    list_filter = ["status"]
    list_select_related = ["node", "rental"]
    search_fields = ["run_id", "node__hostname"]


@admin.register(NodeBenchmark)
class NodeBenchmarkAdmin(ReadOnlyAdmin):
    list_display = ["node", "measured_at", "precision", "matmul_tflops", "mem_bandwidth_gbs"]
    list_select_related = ["node"]


@admin.register(RunMetric)
class RunMetricAdmin(ReadOnlyAdmin):
    list_display = ["run_id", "event", "step", "received_at"]
    list_filter = ["event"]
