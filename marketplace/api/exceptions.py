"""The one place where domain errors become HTTP answers."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from marketplace.errors import DomainError


def exception_handler(exc, context):
    if isinstance(exc, DomainError):
        body: dict = {"detail": exc.message, "code": exc.code}
        if exc.field:
            body = {exc.field: [exc.message], "detail": exc.message, "code": exc.code}
        return Response(body, status=exc.status)
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "message_dict"):
            return Response(exc.message_dict, status=status.HTTP_400_BAD_REQUEST)
        return Response({"detail": exc.messages}, status=status.HTTP_400_BAD_REQUEST)
    return drf_exception_handler(exc, context)
