"""The notifications page. Reads go through the selectors; its form calls the REST API."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from notifications import selectors
from notifications.models import NotificationKind


@require_GET
@login_required
def settings_page(request: HttpRequest) -> HttpResponse:
    row = selectors.notification_settings_get(owner=request.user)
    kinds = [
        {
            "value": value,
            "label": label,
            "email": value not in row.email_off,
            "webhook": value not in row.webhook_off,
        }
        for value, label in NotificationKind.choices
    ]
    return render(
        request,
        "notifications/settings.html",
        {
            "row": row,
            "kinds": kinds,
            "deliveries": selectors.delivery_list(owner=request.user)[:50],
        },
    )
