from django.urls import path

from marketplace.web import views

urlpatterns = [
    path("", views.offers, name="web-offers"),
    path("rentals/", views.rentals, name="web-rentals"),
    path("rentals/new/", views.rental_new, name="web-rental-new"),
    path("rentals/<uuid:rental_id>/", views.rental_detail, name="web-rental"),
    path("tokens/", views.tokens, name="web-tokens"),
    path("ssh-keys/", views.ssh_keys, name="web-ssh-keys"),
    path("provider/", views.provider, name="web-provider"),
    path("team/", views.team, name="web-team"),
    path("teams/switch/", views.team_switch, name="web-team-switch"),
    path("teams/<int:team_id>/join/<str:key>/", views.invitation, name="web-invitation"),
]
