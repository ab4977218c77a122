from django.urls import path

from marketplace.web import views

urlpatterns = [
    path("", views.offers, name="web-offers"),
    path("advisor/", views.advisor, name="web-advisor"),
    path("rentals/", views.rentals, name="web-rentals"),
    path("rentals/new/", views.rental_new, name="web-rental-new"),
    path("rentals/<uuid:rental_id>/", views.rental_detail, name="web-rental"),
    path("datasets/", views.datasets, name="web-datasets"),
    path("tokens/", views.tokens, name="web-tokens"),
    path("ssh-keys/", views.ssh_keys, name="web-ssh-keys"),
    path("provider/", views.provider, name="web-provider"),
]
