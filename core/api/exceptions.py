"""The one place where domain errors become HTTP answers."""

from __future__ import annotations

import logging

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError
from django.http import JsonResponse
from django.views.defaults import page_not_found
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

from core.errors import DomainError

log = logging.getLogger(__name__)


def exception_handler(exc, context):
    if isinstance(exc, DomainError):
        body: dict = {"detail": exc.message, "code": exc.code}
        if exc.field:
            body = {exc.field: [exc.message], "detail": exc.message, "code": exc.code}
        if exc.links:
            body["links"] = exc.links
        response = Response(body, status=exc.status)
        if getattr(exc, "retry_after_s", None):
            response["Retry-After"] = str(exc.retry_after_s)
        return response
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "message_dict"):
            return Response(exc.message_dict, status=status.HTTP_400_BAD_REQUEST)
        return Response({"detail": exc.messages}, status=status.HTTP_400_BAD_REQUEST)
    # The last line of defence, not the validation: input the serializers should have refused
    # reached the database. The client still gets a 4xx, the transaction is rolled back, and the
    # log says which view let it through.
    if isinstance(exc, DataError | IntegrityError):
        set_rollback()
        view = context.get("view")
        log.warning("database refused input in %s: %s", type(view).__name__, exc)
        if isinstance(exc, DataError):
            return Response(
                {"detail": "a value is out of range or not storable", "code": "invalid"},
                status=status.HTTP_400_BAD_REQUEST,
            )
        return Response(
            {"detail": "conflicts with existing data", "code": "conflict"},
            status=status.HTTP_409_CONFLICT,
        )
    return drf_exception_handler(exc, context)


def not_found(request, exception):
    """Django's 404 handler: a URL under /api/ that matches no route (a negative id, a malformed
    UUID) answers JSON like every other API error; the web pages keep the HTML page."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {"detail": "no such resource", "code": "not_found"}, status=status.HTTP_404_NOT_FOUND
        )
    return page_not_found(request, exception)
