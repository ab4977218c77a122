"""Limit/offset pagination for every list endpoint."""

from collections.abc import Iterable

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.views import APIView

MAX_OFFSET = 1_000_000


class Pagination(LimitOffsetPagination):
    default_limit = 50
    max_limit = 500

    def get_offset(self, request) -> int:
        offset = super().get_offset(request)
        if offset > MAX_OFFSET:  # beyond it PostgreSQL's OFFSET overflows, and no page is there
            raise ValidationError({"offset": [f"must be at most {MAX_OFFSET}"]})
        return offset


class PaginatedListView(APIView):
    """An APIView whose GET answers one page of rows.

    The view declares `pagination_class` (rather than making a paginator in its handler) because
    that is what the schema generator reads: with it, the list is documented as the page it is
    (`{count, next, previous, results}`) with its `limit` and `offset` parameters."""

    pagination_class = Pagination

    def paginated(self, rows: Iterable, serializer_class: type, **context) -> Response:
        paginator = self.pagination_class()
        page = paginator.paginate_queryset(rows, self.request, self)
        return paginator.get_paginated_response(
            serializer_class(page, many=True, context=context).data
        )
