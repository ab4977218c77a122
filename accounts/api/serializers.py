"""The wire format of accounts: tokens, SSH keys, teams, members, invitations, who you are."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from accounts.models import ApiToken, TeamRole
from core.api.fields import BoundedDateTimeField, NameField, refuse_unknown


class ApiTokenSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "created_at", "last_used_at", "expires_at", "revoked_at"]


class ApiTokenCreateSerializer(serializers.Serializer):
    name = NameField(max_length=80)
    expires_at = BoundedDateTimeField(required=False, allow_null=True, default=None)


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.CharField(help_text="the secret: shown once, never again")

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]


class SshKeySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    key_type = serializers.CharField()
    bits = serializers.IntegerField()
    fingerprint = serializers.CharField(help_text="SHA256:..., as ssh-keygen -l shows it")
    comment = serializers.CharField()
    public_key = serializers.CharField(help_text="TYPE BASE64, without the comment")
    added_by = serializers.CharField(
        source="owner.username", help_text="the member of the team who added it"
    )
    created_at = serializers.DateTimeField()


class SshKeyCreateSerializer(serializers.Serializer):
    public_key = serializers.CharField(
        max_length=16 * 1024, trim_whitespace=False, help_text="one OpenSSH public key line"
    )
    name = NameField(max_length=80, required=False, default="", allow_blank=True)

    def validate(self, attrs):
        refuse_unknown(self)
        return attrs


class TeamSerializer(serializers.Serializer):
    """A team as one of its members sees it."""

    id = serializers.IntegerField(source="team_id")
    name = serializers.CharField(source="team.name")
    personal = serializers.SerializerMethodField()
    role = serializers.CharField(help_text="your role: owner, billing or member")

    def get_personal(self, membership) -> bool:
        return membership.team.personal_of_id == membership.user_id


class MeSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    username = serializers.CharField()
    email = serializers.CharField()
    is_staff = serializers.BooleanField()
    providers = serializers.SerializerMethodField(help_text="the names of the providers you own")
    team = serializers.SerializerMethodField(
        help_text="the team these credentials act for: a token's own team, a session's current"
    )

    def get_providers(self, user) -> list[str]:
        return list(user.providers.values_list("name", flat=True))

    @extend_schema_field(TeamSerializer(allow_null=True))
    def get_team(self, user) -> dict | None:
        membership = self.context.get("membership")
        return TeamSerializer(membership).data if membership is not None else None


class TeamCreateSerializer(serializers.Serializer):
    name = NameField(max_length=80)


class MemberSerializer(serializers.Serializer):
    id = serializers.IntegerField(help_text="the membership's id")
    user = serializers.IntegerField(source="user_id")
    username = serializers.CharField(source="user.username")
    email = serializers.CharField(source="user.email")
    role = serializers.CharField()
    created_at = serializers.DateTimeField()


class MemberRoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=TeamRole.choices)


class InvitationSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    email = serializers.EmailField()
    role = serializers.CharField()
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()


class InvitationCreateSerializer(serializers.Serializer):
    email = serializers.EmailField(max_length=254)
    role = serializers.ChoiceField(choices=TeamRole.choices, default=TeamRole.MEMBER)


class InvitationCreatedSerializer(InvitationSerializer):
    link = serializers.CharField(help_text="the accept link, shown once (also mailed)")
    mailed = serializers.BooleanField(help_text="whether the mail went out")


class InvitationAcceptSerializer(serializers.Serializer):
    team = serializers.IntegerField(help_text="the team id in the invitation's link")
    key = serializers.CharField(max_length=200, help_text="the secret in the invitation's link")


class SecretSerializer(serializers.Serializer):
    """A team secret as anyone sees it: its name and times, never its value."""

    name = serializers.CharField()
    created_by = serializers.CharField(source="created_by.username", allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class SecretSetSerializer(serializers.Serializer):
    name = serializers.CharField(
        max_length=64, help_text="a variable name: letters, digits and _ (the run's $NAME)"
    )
    value = serializers.CharField(
        max_length=64 * 1024,
        trim_whitespace=False,
        help_text="the value (at most 64 KiB, no NUL): stored encrypted, never shown again",
    )

    def validate(self, attrs):
        refuse_unknown(self)
        return attrs
