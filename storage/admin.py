"""Rows that mirror objects in the bucket, for staff to read: written by the storage services
only."""

from __future__ import annotations

from django.contrib import admin

from storage.models import Artifact, Dataset, DatasetFile


class _ReadOnly(admin.ModelAdmin):
    """Rows that mirror objects in the bucket: written by the storage services only."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class DatasetFileInline(admin.TabularInline):
    model = DatasetFile
    fields = ["path", "size_bytes", "sha256", "stored_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Dataset)
class DatasetAdmin(_ReadOnly):
    list_display = ["name", "team", "owner", "status", "total_bytes", "file_count", "created_at"]
    list_filter = ["status"]
    list_select_related = ["team", "owner"]
    search_fields = ["id", "name", "team__name", "owner__username"]
    inlines = [DatasetFileInline]


@admin.register(Artifact)
class ArtifactAdmin(_ReadOnly):
    list_display = ["rental", "path", "size_bytes", "reason", "synced_at"]
    list_select_related = ["rental"]
    search_fields = ["rental__id", "path"]
