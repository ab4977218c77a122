from django.contrib import admin

from notifications.models import Delivery, Notification, NotificationSettings


@admin.register(NotificationSettings)
class NotificationSettingsAdmin(admin.ModelAdmin):
    list_display = ("team", "email_enabled", "webhook_url", "updated_at")
    search_fields = ("team__name",)
    readonly_fields = ("webhook_secret_salt", "webhook_secret_rotated_at", "updated_at")
    raw_id_fields = ("team",)


class DeliveryInline(admin.TabularInline):
    model = Delivery
    extra = 0
    can_delete = False
    readonly_fields = (
        "channel",
        "recipient",
        "state",
        "attempts",
        "next_attempt_at",
        "last_status_code",
        "last_error",
        "delivered_at",
    )

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Notification)
class NotificationAdmin(admin.ModelAdmin):
    """Read-only: the outbox is written by the services and delivered by the workers."""

    list_display = ("id", "kind", "team", "summary", "created_at")
    list_filter = ("kind",)
    search_fields = ("team__name", "source_key", "summary")
    inlines = [DeliveryInline]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
