"""The advisor's page: the browser calls /api/v1/advisor/ with the session, so it gets exactly
the validation and the errors a program gets."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from advisor.calibration import accuracy
from advisor.engine.presets import PRESETS


@require_GET
def advisor(request: HttpRequest) -> HttpResponse:
    """Which card to rent for a training run, and what it costs; each answer books in one step."""
    presets = sorted(PRESETS, key=lambda name: PRESETS[name].params)
    return render(request, "advisor/advisor.html", {"presets": presets, "accuracy": accuracy()})
