from django.urls import path

from provisioning.api import views

agent_urlpatterns = [
    path("join/", views.JoinView.as_view(), name="agent-join"),
    path("heartbeat/", views.HeartbeatView.as_view(), name="agent-heartbeat"),
]

rental_urlpatterns = [
    path("<uuid:rental_id>/metrics/", views.RentalMetricsView.as_view(), name="rental-metrics"),
    path("<uuid:rental_id>/logs/", views.RentalLogsView.as_view(), name="rental-logs"),
]

provider_urlpatterns = [
    path("join-tokens/", views.JoinTokenCreateView.as_view(), name="join-token-create"),
]
