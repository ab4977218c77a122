"""Input and output shapes of the notifications API; no logic beyond field checks."""

from __future__ import annotations

from rest_framework import serializers

from notifications.models import Delivery, DeliveryState, NotificationKind, NotificationSettings

_KINDS = NotificationKind.values


def _kinds_field(channel: str) -> serializers.ListField:
    return serializers.ListField(
        child=serializers.ChoiceField(choices=NotificationKind.choices),
        max_length=len(_KINDS),
        required=False,
        help_text=f"the kinds told by {channel}; every other kind is switched off",
    )


class NotificationSettingsSerializer(serializers.ModelSerializer):
    webhook_url = serializers.CharField(read_only=True, help_text="empty when there is none")
    email_kinds = serializers.SerializerMethodField()
    webhook_kinds = serializers.SerializerMethodField()
    webhook_secret_set = serializers.SerializerMethodField()
    kinds = serializers.SerializerMethodField(help_text="every kind, for switching on and off")

    class Meta:
        model = NotificationSettings
        fields = [
            "email_enabled",
            "email_kinds",
            "webhook_url",
            "webhook_kinds",
            "webhook_secret_set",
            "webhook_secret_rotated_at",
            "kinds",
        ]
        read_only_fields = fields

    def get_email_kinds(self, row: NotificationSettings) -> list[str]:
        return [k for k in _KINDS if k not in row.email_off]

    def get_webhook_kinds(self, row: NotificationSettings) -> list[str]:
        return [k for k in _KINDS if k not in row.webhook_off]

    def get_webhook_secret_set(self, row: NotificationSettings) -> bool:
        return bool(row.webhook_secret_salt)

    def get_kinds(self, row: NotificationSettings) -> list[str]:
        return list(_KINDS)


class NotificationSettingsChangedSerializer(NotificationSettingsSerializer):
    webhook_secret = serializers.CharField(
        allow_null=True,
        help_text="the webhook signing secret when this change made one: shown once, never again",
    )

    class Meta(NotificationSettingsSerializer.Meta):
        fields = [*NotificationSettingsSerializer.Meta.fields, "webhook_secret"]
        read_only_fields = fields


class NotificationSettingsUpdateSerializer(serializers.Serializer):
    email_enabled = serializers.BooleanField(required=False)
    email_kinds = _kinds_field("email")
    webhook_url = serializers.CharField(
        max_length=500,
        allow_blank=True,
        required=False,
        trim_whitespace=False,
        help_text="https URL the events are POSTed to; empty turns the webhook off",
    )
    webhook_kinds = _kinds_field("webhook")


class DeliveryListQuerySerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=DeliveryState.choices, required=False, default=None)


class DeliverySerializer(serializers.ModelSerializer):
    event_id = serializers.UUIDField(source="notification_id", read_only=True)
    kind = serializers.CharField(source="notification.kind", read_only=True)
    summary = serializers.CharField(source="notification.summary", read_only=True)
    rental_id = serializers.UUIDField(source="notification.rental_id", read_only=True)

    class Meta:
        model = Delivery
        fields = [
            "id",
            "event_id",
            "kind",
            "summary",
            "rental_id",
            "channel",
            "recipient",
            "state",
            "attempts",
            "last_attempt_at",
            "last_status_code",
            "last_error",
            "next_attempt_at",
            "delivered_at",
            "created_at",
        ]
        read_only_fields = fields
