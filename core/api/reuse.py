"""Serializers built once per thread.

DRF builds a serializer's field tree afresh for every instance: a deep copy of each declared
field, nested serializers included. For the hot endpoints (a rental's create and its answer, an
agent's heartbeat) that copy cost more server time than the validation itself, so each thread
keeps one instance of such a serializer and hands it out again, holding nothing of the body or
object it last saw.

Only for serializers used whole, one at a time per thread (a view's body or answer): the
instance is shared by every request the thread serves, so a caller keeps what it needs from it
(`validated_data`, `data`) before asking for the same serializer again.
"""

from __future__ import annotations

import threading
from typing import Any, Self

# What a serializer caches of the one body or object it saw.
_PER_USE = ("initial_data", "_validated_data", "_errors", "_data")


class ReusedPerThread:
    """Mixin for a `serializers.Serializer`: `for_data(body)` to validate, `for_instance(obj)`
    to render, each giving this thread's instance. Subclasses that keep state of their own in
    fields (counters) clear it in `forget`."""

    _per_thread: threading.local

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._per_thread = threading.local()  # one per class: a subclass is another tree

    @classmethod
    def _this_thread(cls) -> Self:
        body = getattr(cls._per_thread, "instance", None)
        if body is None:
            body = cls._per_thread.instance = cls()
        for cached in _PER_USE:
            body.__dict__.pop(cached, None)
        body.instance = None
        body.forget()
        return body

    @classmethod
    def for_data(cls, data: Any) -> Self:
        """This thread's instance, to validate `data` with."""
        body = cls._this_thread()
        body.initial_data = data
        return body

    @classmethod
    def for_instance(cls, instance: Any) -> Self:
        """This thread's instance, to render `instance` with."""
        body = cls._this_thread()
        body.instance = instance
        return body

    def forget(self) -> None:
        """Clear what the fields themselves kept of the last use (nothing, by default)."""
