from django.urls import path
from rest_framework.routers import SimpleRouter

from marketplace.api import views

router = SimpleRouter()
router.register("gpu-models", views.GpuModelViewSet, basename="gpu-model")

urlpatterns = [
    path("offers/", views.OfferListView.as_view(), name="offer-list"),
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
