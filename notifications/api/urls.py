from django.urls import path

from notifications.api import views

urlpatterns = [
    path("settings/", views.NotificationSettingsView.as_view(), name="notification-settings"),
    path(
        "settings/rotate-secret/",
        views.WebhookSecretRotateView.as_view(),
        name="notification-secret-rotate",
    ),
    path("deliveries/", views.DeliveryListView.as_view(), name="notification-deliveries"),
    path(
        "deliveries/<int:delivery_id>/",
        views.DeliveryDetailView.as_view(),
        name="notification-delivery",
    ),
]
