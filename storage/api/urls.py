from django.urls import path

from storage.api import views

# Mounted at /api/v1/datasets/.
urlpatterns = [
    path("", views.DatasetListCreateView.as_view(), name="dataset-list"),
    path("<uuid:dataset_id>/", views.DatasetDetailView.as_view(), name="dataset-detail"),
    path(
        "<uuid:dataset_id>/uploads/",
        views.DatasetUploadUrlsView.as_view(),
        name="dataset-uploads",
    ),
    path(
        "<uuid:dataset_id>/complete/",
        views.DatasetCompleteView.as_view(),
        name="dataset-complete",
    ),
]

# Mounted at /api/v1/rentals/: a rental's synced output.
rental_urlpatterns = [
    path(
        "<uuid:rental_id>/artifacts/",
        views.RentalArtifactListView.as_view(),
        name="rental-artifacts",
    ),
    path(
        "<uuid:rental_id>/artifacts/download/",
        views.RentalArtifactDownloadView.as_view(),
        name="rental-artifact-download",
    ),
]
