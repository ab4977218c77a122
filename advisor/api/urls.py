from django.urls import path

from advisor.api import views

urlpatterns = [
    path("", views.AdvisorView.as_view(), name="advisor"),
    path("memory/", views.AdvisorMemoryView.as_view(), name="advisor-memory"),
    path("estimate/", views.AdvisorEstimateView.as_view(), name="advisor-estimate"),
    path("accuracy/", views.AdvisorAccuracyView.as_view(), name="advisor-accuracy"),
    path("book/", views.AdvisorBookView.as_view(), name="advisor-book"),
]
