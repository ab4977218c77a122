"""Teams, their members and invitations, and API tokens for ops (staff only, as the admin
always is)."""

from django.contrib import admin

from accounts.models import ApiToken, Invitation, Membership, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    fields = ["user", "role", "created_at"]
    readonly_fields = ["created_at"]
    raw_id_fields = ["user"]
    extra = 0


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "personal_of", "created_at"]
    search_fields = ["name", "memberships__user__username", "memberships__user__email"]
    list_select_related = ["personal_of"]
    readonly_fields = ["personal_of", "created_at"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["team", "user", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["team__name", "user__username", "user__email"]
    list_select_related = ["team", "user"]
    raw_id_fields = ["team", "user"]


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    list_display = [
        "email",
        "team",
        "role",
        "created_at",
        "expires_at",
        "accepted_at",
        "revoked_at",
    ]
    list_filter = ["role"]
    search_fields = ["email", "team__name"]
    list_select_related = ["team"]
    readonly_fields = [
        "team",
        "email",
        "role",
        "key_hash",
        "invited_by",
        "created_at",
        "expires_at",
        "accepted_at",
        "accepted_by",
    ]

    def has_add_permission(self, request) -> bool:
        # Invitations are made by a team's owners so that the link reaches the invited only.
        return False


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "team", "prefix", "created_at", "last_used_at", "revoked_at"]
    list_select_related = ["user", "team"]
    readonly_fields = ["prefix", "key_hash", "created_at", "last_used_at"]
    search_fields = ["name", "prefix", "user__username", "team__name"]

    def has_add_permission(self, request) -> bool:
        # Tokens are created through the API so that the secret is shown to its owner only.
        return False
