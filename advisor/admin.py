"""The advisor's calibration, for staff to read: written by the calibration service only."""

from django.contrib import admin

from advisor.models import AdvisorCheck, AdvisorPrior


class _ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(AdvisorPrior)
class AdvisorPriorAdmin(_ReadOnly):
    list_display = ["card", "mfu", "runs", "updated_at"]
    list_select_related = ["card"]


@admin.register(AdvisorCheck)
class AdvisorCheckAdmin(_ReadOnly):
    list_display = [
        "rental",
        "card",
        "gpus",
        "estimated_step_s",
        "measured_step_s",
        "simulated",
        "created_at",
    ]
    list_filter = ["card"]
    search_fields = ["rental__id"]
