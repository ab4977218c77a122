from django.urls import path

from storage import views

urlpatterns = [
    path("", views.datasets, name="web-datasets"),
]
