from django.urls import path

from notifications import views

urlpatterns = [
    path("", views.settings_page, name="notifications-web"),
]
