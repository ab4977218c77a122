from django.urls import path
from rest_framework.routers import SimpleRouter

from marketplace.api import views

router = SimpleRouter()
router.register("gpu-models", views.GpuModelViewSet, basename="gpu-model")

urlpatterns = [
    path("offers/", views.OfferListView.as_view(), name="offer-list"),
    path("tokens/", views.ApiTokenListCreateView.as_view(), name="token-list"),
    path("tokens/<int:token_id>/revoke/", views.ApiTokenRevokeView.as_view(), name="token-revoke"),
    path("ssh-keys/", views.SshKeyListCreateView.as_view(), name="ssh-key-list"),
    path("ssh-keys/<int:key_id>/", views.SshKeyDetailView.as_view(), name="ssh-key-detail"),
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
    path("rentals/", views.RentalListCreateView.as_view(), name="rental-list"),
    path("rentals/<uuid:rental_id>/", views.RentalDetailView.as_view(), name="rental-detail"),
    path(
        "rentals/<uuid:rental_id>/cancel/", views.RentalCancelView.as_view(), name="rental-cancel"
    ),
    path("rentals/<uuid:rental_id>/stop/", views.RentalStopView.as_view(), name="rental-stop"),
    path("providers/", views.ProviderListView.as_view(), name="provider-list"),
    path(
        "providers/<int:provider_id>/nodes/",
        views.ProviderNodeListView.as_view(),
        name="provider-nodes",
    ),
    path(
        "providers/nodes/<int:node_id>/",
        views.ProviderNodePriceView.as_view(),
        name="provider-node",
    ),
    path(
        "providers/nodes/<int:node_id>/action/",
        views.ProviderNodeActionView.as_view(),
        name="provider-node-action",
    ),
    *router.urls,
]
