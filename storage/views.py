"""The datasets page: it uploads files straight to object storage through the REST API's
presigned URLs (in parts for big files), with a progress bar."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from accounts.tenancy import request_team, team_page
from storage import selectors


@require_GET
@login_required
@team_page
def datasets(request: HttpRequest) -> HttpResponse:
    """Your team's datasets, with the quota they use."""
    team = request_team(request)
    return render(
        request,
        "storage/datasets.html",
        {
            "datasets": selectors.datasets_owned(team)
            .select_related("owner")
            .order_by("-created_at"),
            "used": selectors.dataset_bytes_used(team),
            "quota": settings.STORAGE["DATASET_QUOTA_BYTES"],
        },
    )
