from django.urls import path
from rest_framework.routers import SimpleRouter

from marketplace.api import views

router = SimpleRouter()
router.register("gpu-models", views.GpuModelViewSet, basename="gpu-model")

urlpatterns = [
    path("offers/", views.OfferListView.as_view(), name="offer-list"),
    path("tokens/", views.ApiTokenListCreateView.as_view(), name="token-list"),
    path("tokens/<int:token_id>/revoke/", views.ApiTokenRevokeView.as_view(), name="token-revoke"),
    path("me/", views.MeView.as_view(), name="me"),
    *router.urls,
]
