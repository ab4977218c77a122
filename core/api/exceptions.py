"""The one place where domain errors become HTTP answers."""

from __future__ import annotations

import logging

from django.core.exceptions import RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError
from django.http import JsonResponse
from django.views.defaults import bad_request, page_not_found, permission_denied, server_error
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

from core.errors import DomainError

log = logging.getLogger(__name__)


def exception_handler(exc, context):
    if isinstance(exc, RequestDataTooBig):
        # Django's own limit on a body read whole (DATA_UPLOAD_MAX_MEMORY_SIZE): a 413 like the
        # parser's, in JSON, not Django's HTML 400 page.
        return Response(
            {"detail": "the request body is too large", "code": "payload_too_large"},
            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
        )
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


def _api(request) -> bool:
    return request.path.startswith("/api/")


def bad_request_handler(request, exception):
    """Django's 400 handler (a body past Django's own limits, a bad host header, a suspicious
    operation outside a DRF view): JSON under /api/, the HTML page elsewhere."""
    if _api(request):
        return JsonResponse({"detail": "bad request", "code": "invalid"}, status=400)
    return bad_request(request, exception)


def permission_denied_handler(request, exception):
    if _api(request):
        return JsonResponse({"detail": "forbidden", "code": "forbidden"}, status=403)
    return permission_denied(request, exception)


def server_error_handler(request):
    if _api(request):
        return JsonResponse({"detail": "server error", "code": "error"}, status=500)
    return server_error(request)


def not_found(request, exception):
    """Django's 404 handler: a URL under /api/ that matches no route (a negative id, a malformed
    UUID) answers JSON like every other API error; the web pages keep the HTML page."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {"detail": "no such resource", "code": "not_found"}, status=status.HTTP_404_NOT_FOUND
        )
    return page_not_found(request, exception)
