from django.urls import path

from billing import views

urlpatterns = [
    path("stripe/webhook/", views.stripe_webhook, name="billing-stripe-webhook"),
    path("", views.account_page, name="billing-web-account"),
    path("topup/", views.topup_page, name="billing-topup"),
]
