"""Top-level URLs: the admin, the versioned API, its schema and docs, the web UI."""

from allauth.account.decorators import secure_admin_login
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from accounts.signup import ConfirmEmailView
from config.observability.health import healthz, readyz
from config.observability.metrics import metrics_view
from marketplace.api import urls as marketplace_api
from provisioning import web as provisioning_web
from provisioning.api import urls as provisioning_api
from storage.api import urls as storage_api

# Staff sign in through allauth (password, then TOTP), never through the admin's own form.
admin.site.login = secure_admin_login(admin.site.login)

# Every error under /api/ answers JSON, whichever layer raised it.
handler400 = "core.api.exceptions.bad_request_handler"
handler403 = "core.api.exceptions.permission_denied_handler"
handler404 = "core.api.exceptions.not_found"
handler500 = "core.api.exceptions.server_error_handler"

urlpatterns = [
    # First: the agents' requests are the most frequent, and Django tries the routes in order.
    path("api/agent/v1/", include(provisioning_api.agent_urlpatterns)),
    path("admin/", admin.site.urls),
    path(
        "accounts/confirm-email/<str:key>/",
        ConfirmEmailView.as_view(),
        name="account_confirm_email",
    ),
    path("accounts/", include("allauth.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/", include("accounts.api.urls")),
    path("api/v1/", include("marketplace.api.urls")),
    # Each prefix once: a rental's routes from the marketplace (the rental), provisioning (its
    # metrics and logs) and storage (its artifacts); a provider's from the marketplace (nodes,
    # prices) and provisioning (join tokens).
    path(
        "api/v1/rentals/",
        include(
            [
                *marketplace_api.rental_urlpatterns,
                *provisioning_api.rental_urlpatterns,
                *storage_api.rental_urlpatterns,
            ]
        ),
    ),
    path(
        "api/v1/providers/",
        include([*marketplace_api.provider_urlpatterns, *provisioning_api.provider_urlpatterns]),
    ),
    path("api/v1/advisor/", include("advisor.api.urls")),
    path("api/v1/billing/", include("billing.api.urls")),
    path("billing/", include("billing.urls")),
    path("api/v1/notifications/", include("notifications.api.urls")),
    path("notifications/", include("notifications.urls")),
    path("api/v1/datasets/", include("storage.api.urls")),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path("metrics", metrics_view, name="metrics"),
    path("provider/onboard/", provisioning_web.onboard, name="provider-onboard"),
    path(
        "provider/onboard/join-token/",
        provisioning_web.onboard_join_token,
        name="provider-onboard-join-token",
    ),
    path(
        "provider/onboard/payouts/",
        provisioning_web.onboard_payouts,
        name="provider-onboard-payouts",
    ),
    path("advisor/", include("advisor.urls")),
    path("datasets/", include("storage.urls")),
    path("", include("accounts.urls")),
    path("", include("marketplace.web.urls")),
]
