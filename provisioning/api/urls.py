from django.urls import path

from provisioning.api import views

agent_urlpatterns = [
    path("join/", views.JoinView.as_view(), name="agent-join"),
    path("heartbeat/", views.HeartbeatView.as_view(), name="agent-heartbeat"),
    # agentprotocol.ARTIFACT_UPLOADS_PATH and ARTIFACT_COMMIT_PATH
    path(
        "rentals/<uuid:rental_id>/artifacts/uploads/",
        views.ArtifactUploadsView.as_view(),
        name="agent-artifact-uploads",
    ),
    path(
        "rentals/<uuid:rental_id>/artifacts/commit/",
        views.ArtifactCommitView.as_view(),
        name="agent-artifact-commit",
    ),
]

rental_urlpatterns = [
    path("<uuid:rental_id>/metrics/", views.RentalMetricsView.as_view(), name="rental-metrics"),
    path("<uuid:rental_id>/logs/", views.RentalLogsView.as_view(), name="rental-logs"),
]

provider_urlpatterns = [
    path("join-tokens/", views.JoinTokenCreateView.as_view(), name="join-token-create"),
]
