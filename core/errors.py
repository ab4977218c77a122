"""Domain errors: raised by services, mapped to HTTP once in the API exception handler."""

from __future__ import annotations


class DomainError(Exception):
    """Base class; `status` is the HTTP status the API answers with."""

    status = 400
    code = "invalid"

    def __init__(
        self, message: str, *, field: str | None = None, links: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        # Where the caller can go next (e.g. the top-up page of a 402), as paths.
        self.links = links or {}


class ValidationFailed(DomainError):
    status = 400
    code = "invalid"


class NotFound(DomainError):
    status = 404
    code = "not_found"


class Conflict(DomainError):
    """The request is valid but the current state forbids it (e.g. an illegal transition)."""

    status = 409
    code = "conflict"


class InsufficientCapacity(Conflict):
    code = "insufficient_capacity"


class PaymentRequired(DomainError):
    status = 402
    code = "payment_required"


class Forbidden(DomainError):
    """The caller is known but their role does not allow this (e.g. a member paying)."""

    status = 403
    code = "forbidden"
