"""The accounts API, mounted at /api/v1/: tokens, SSH keys, secrets, who you are, teams, members and
invitations."""

from django.urls import path

from accounts.api import views

urlpatterns = [
    path("tokens/", views.ApiTokenListCreateView.as_view(), name="token-list"),
    path("tokens/<int:token_id>/revoke/", views.ApiTokenRevokeView.as_view(), name="token-revoke"),
    path("ssh-keys/", views.SshKeyListCreateView.as_view(), name="ssh-key-list"),
    path("ssh-keys/<int:key_id>/", views.SshKeyDetailView.as_view(), name="ssh-key-detail"),
    path("secrets/", views.SecretListSetView.as_view(), name="secret-list"),
    path("secrets/<str:name>/", views.SecretDetailView.as_view(), name="secret-detail"),
    path("me/", views.MeView.as_view(), name="me"),
    path("teams/", views.TeamListCreateView.as_view(), name="team-list"),
    path("team/members/", views.TeamMemberListView.as_view(), name="team-members"),
    path(
        "team/members/<int:membership_id>/",
        views.TeamMemberView.as_view(),
        name="team-member",
    ),
    path("team/invitations/", views.InvitationListCreateView.as_view(), name="team-invitations"),
    path(
        "team/invitations/<int:invitation_id>/revoke/",
        views.InvitationRevokeView.as_view(),
        name="team-invitation-revoke",
    ),
    path("invitations/accept/", views.InvitationAcceptView.as_view(), name="invitation-accept"),
]
