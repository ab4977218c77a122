from django.urls import path
from rest_framework.routers import SimpleRouter

from marketplace.api import advisor, storage, views

router = SimpleRouter()
router.register("gpu-models", views.GpuModelViewSet, basename="gpu-model")

urlpatterns = [
    path("offers/", views.OfferListView.as_view(), name="offer-list"),
    path("tokens/", views.ApiTokenListCreateView.as_view(), name="token-list"),
    path("tokens/<int:token_id>/revoke/", views.ApiTokenRevokeView.as_view(), name="token-revoke"),
    path("ssh-keys/", views.SshKeyListCreateView.as_view(), name="ssh-key-list"),
    path("ssh-keys/<int:key_id>/", views.SshKeyDetailView.as_view(), name="ssh-key-detail"),
    path("me/", views.MeView.as_view(), name="me"),
    path("advisor/", advisor.AdvisorView.as_view(), name="advisor"),
    path("advisor/memory/", advisor.AdvisorMemoryView.as_view(), name="advisor-memory"),
    path("advisor/estimate/", advisor.AdvisorEstimateView.as_view(), name="advisor-estimate"),
    path("advisor/accuracy/", advisor.AdvisorAccuracyView.as_view(), name="advisor-accuracy"),
    path("advisor/book/", advisor.AdvisorBookView.as_view(), name="advisor-book"),
    path("rentals/", views.RentalListCreateView.as_view(), name="rental-list"),
    path("rentals/<uuid:rental_id>/", views.RentalDetailView.as_view(), name="rental-detail"),
    path(
        "rentals/<uuid:rental_id>/cancel/", views.RentalCancelView.as_view(), name="rental-cancel"
    ),
    path("rentals/<uuid:rental_id>/stop/", views.RentalStopView.as_view(), name="rental-stop"),
    path(
        "rentals/<uuid:rental_id>/artifacts/",
        storage.RentalArtifactListView.as_view(),
        name="rental-artifacts",
    ),
    path(
        "rentals/<uuid:rental_id>/artifacts/download/",
        storage.RentalArtifactDownloadView.as_view(),
        name="rental-artifact-download",
    ),
    path("datasets/", storage.DatasetListCreateView.as_view(), name="dataset-list"),
    path("datasets/<uuid:dataset_id>/", storage.DatasetDetailView.as_view(), name="dataset-detail"),
    path(
        "datasets/<uuid:dataset_id>/uploads/",
        storage.DatasetUploadUrlsView.as_view(),
        name="dataset-uploads",
    ),
    path(
        "datasets/<uuid:dataset_id>/complete/",
        storage.DatasetCompleteView.as_view(),
        name="dataset-complete",
    ),
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
