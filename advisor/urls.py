from django.urls import path

from advisor import views

urlpatterns = [
    path("", views.advisor, name="web-advisor"),
]
