"""The account pages, mounted at the site's root."""

from django.urls import path

from accounts import views

urlpatterns = [
    path("tokens/", views.tokens, name="web-tokens"),
    path("ssh-keys/", views.ssh_keys, name="web-ssh-keys"),
    path("secrets/", views.secrets, name="web-secrets"),
    path("team/", views.team, name="web-team"),
    path("teams/switch/", views.team_switch, name="web-team-switch"),
    path("teams/<int:team_id>/join/<str:key>/", views.invitation, name="web-invitation"),
]
