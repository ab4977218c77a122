"""The notifications page. Reads go through the selectors; its form calls the REST API."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from accounts.tenancy import request_membership, request_team, team_page
from notifications import selectors
from notifications.models import NotificationKind


@require_GET
@login_required
@team_page
def settings_page(request: HttpRequest) -> HttpResponse:
    """The team's settings and deliveries; members read them, owners and billing members
    change them (the form is shown to them only; the API refuses the others too)."""
    team = request_team(request)
    row = selectors.notification_settings_get(team=team)
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
            "team": team,
            "can_change": request_membership(request).manages_money,
            "deliveries": selectors.delivery_list(team=team)[:50],
        },
    )
