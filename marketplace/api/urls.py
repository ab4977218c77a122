from django.urls import path
from rest_framework.routers import SimpleRouter

from marketplace.api import views

router = SimpleRouter()
router.register("gpu-models", views.GpuModelViewSet, basename="gpu-model")

urlpatterns = [
    path("offers/", views.OfferListView.as_view(), name="offer-list"),
    path("templates/", views.TemplateListCreateView.as_view(), name="template-list"),
    path("templates/<slug:name>/", views.TemplateDetailView.as_view(), name="template-detail"),
    *router.urls,
]

# /api/v1/rentals/ and /api/v1/providers/ are mounted once, in config/urls.py, with the routes
# the apps above the marketplace add under them (a rental's metrics, logs and artifacts; join
# tokens): the marketplace cannot import those apps.
rental_urlpatterns = [
    path("", views.RentalListCreateView.as_view(), name="rental-list"),
    path("<uuid:rental_id>/", views.RentalDetailView.as_view(), name="rental-detail"),
    path("<uuid:rental_id>/cancel/", views.RentalCancelView.as_view(), name="rental-cancel"),
    path("<uuid:rental_id>/stop/", views.RentalStopView.as_view(), name="rental-stop"),
]

provider_urlpatterns = [
    path("", views.ProviderListView.as_view(), name="provider-list"),
    path("<int:provider_id>/nodes/", views.ProviderNodeListView.as_view(), name="provider-nodes"),
    path("nodes/<int:node_id>/", views.ProviderNodePriceView.as_view(), name="provider-node"),
    path(
        "<int:provider_id>/clusters/",
        views.ProviderClusterListView.as_view(),
        name="provider-clusters",
    ),
    path(
        "clusters/<int:cluster_id>/",
        views.ProviderClusterDetailView.as_view(),
        name="provider-cluster",
    ),
    path(
        "nodes/<int:node_id>/action/",
        views.ProviderNodeActionView.as_view(),
        name="provider-node-action",
    ),
]
