"""Input fields bounded to what the database and Python's datetime can hold, and the refusal
of fields a serializer does not take."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from rest_framework import serializers

from core.untrusted_text import unsafe_character

# PostgreSQL's integer column, the narrowest integer this API stores.
INT32_MAX = 2**31 - 1
# A date outside these years is a mistake, and near datetime's limits adding a duration to it
# overflows in Python before PostgreSQL ever sees it.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 1, 1, tzinfo=UTC)


class BoundedDateTimeField(serializers.DateTimeField):
    """A DateTimeField that refuses dates before 2000 or after 9998."""

    def to_internal_value(self, value):
        parsed = super().to_internal_value(value)
        if not EARLIEST <= parsed < LATEST:
            raise serializers.ValidationError(
                f"must be between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d}"
            )
        return parsed


class NameField(serializers.CharField):
    """A name a person reads (a rental's, a team's, a key's, a token's, a card's): a control,
    bidi or invisible character is refused, so a name cannot hide or reorder part of itself."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        bad = unsafe_character(value)
        if bad is not None:
            raise serializers.ValidationError(
                f"{bad} (a control, bidi or invisible character) is not allowed"
            )
        return value


def refuse_unknown(
    serializer: serializers.Serializer, *, also: Iterable[str] = (), why: str = "unknown field"
) -> None:
    """A request naming a field the serializer does not take is refused, naming it: a typo must
    not silently become the default."""
    unknown = set(serializer.initial_data) - set(serializer.fields) - set(also)
    if unknown:
        raise serializers.ValidationError({name: [why] for name in sorted(unknown)})
