from django.urls import path

from marketplace.web import views

urlpatterns = [
    path("", views.offers, name="web-offers"),
    path("rentals/", views.rentals, name="web-rentals"),
    path("rentals/new/", views.rental_new, name="web-rental-new"),
    path("rentals/<uuid:rental_id>/", views.rental_detail, name="web-rental"),
    path("templates/", views.templates, name="web-templates"),
    path("provider/", views.provider, name="web-provider"),
]
