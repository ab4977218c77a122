"""Limit/offset pagination for every list endpoint."""

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 1_000_000


class Pagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 500

    def get_offset(self, request) -> int:
        offset = super().get_offset(request)
        if offset > MAX_OFFSET:  # beyond it PostgreSQL's OFFSET overflows, and no page is there
            raise ValidationError({"offset": [f"must be at most {MAX_OFFSET}"]})
        return offset
