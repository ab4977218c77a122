"""Model rows in and out of PostgreSQL without compiling a statement on every call.

On a create, Django compiling an INSERT (or a join) for each call costs more CPU than the
database spends running it. Here the statement is built once per model from the model's own
fields, and each value goes through the same field methods the ORM calls (`pre_save`,
`get_db_prep_save`, the fields' database converters), so a row written or read here is the row
the ORM would write or read.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import TypeVar

from django.db import connection, models
from django.db.models.expressions import DatabaseDefault, Value

M = TypeVar("M", bound=models.Model)


@cache
def _insert_statement(model: type[models.Model]) -> tuple[str, tuple, tuple]:
    """The INSERT of one row of `model`: its SQL, the fields it writes, the fields it returns.
    The fields are those Model.save() inserts when the auto primary key is left to the
    database."""
    meta = model._meta
    if meta.parents or meta.order_with_respect_to:
        raise TypeError(f"{model.__name__}: multi-table or ordered models are not inserted here")
    fields = tuple(
        f for f in meta.local_concrete_fields if not f.generated and f is not meta.auto_field
    )
    returning = tuple(meta.db_returning_fields)
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    placeholders = ", ".join(["%s"] * len(fields))
    sql = f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({placeholders})"  # noqa: S608
    if returning:
        sql += f" RETURNING {', '.join(quote(f.column) for f in returning)}"
    return sql, fields, returning


def model_insert(obj: M) -> M:
    """Insert a new, unsaved instance as `Model.save(force_insert=True)` would (auto_now
    values set, the database's returned columns read back), in one prepared statement. No
    signals are sent: this codebase uses none. A value that is an expression (a `db_default`, an
    `F()`) needs the ORM's compiler, and the instance is then saved through it."""
    meta = obj._meta
    if meta.auto_field is not None and getattr(obj, meta.auto_field.attname) is not None:
        raise ValueError(f"{type(obj).__name__}: its auto primary key is already set")
    sql, fields, returning = _insert_statement(type(obj))
    params = insert_values(obj, fields)
    if params is None:
        obj.save(force_insert=True)
        return obj
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone() if returning else ()
    for field, value in zip(returning, row, strict=True):
        setattr(obj, field.attname, _converted(field, value))
    return mark_saved(obj)


def mark_saved(obj: M) -> M:
    """The instance is a row of the database now (its INSERT went through a statement here)."""
    obj._state.adding = False
    obj._state.db = connection.alias
    return obj


def insert_values(obj: models.Model, fields) -> list | None:
    """The values an INSERT of the new instance writes for `fields`, as the ORM prepares them
    (auto_now set on the instance); None when one is an expression, which only the ORM's
    compiler can write."""
    values = [_db_default_literal(field, field.pre_save(obj, add=True)) for field in fields]
    if any(hasattr(value, "resolve_expression") for value in values):
        return None
    return [
        field.get_db_prep_save(value, connection=connection)
        for field, value in zip(fields, values, strict=True)
    ]


def pipelined(statements: Sequence[tuple[str, Sequence]]) -> list[list[tuple]]:
    """Run the statements in order, sent together and answered together (psycopg's pipeline
    mode): one round trip instead of one each. The server runs each as soon as the one before
    it ends, each with a snapshot of its own as any statement in READ COMMITTED, so a read
    sent behind a `FOR UPDATE` sees what the lock's previous holder committed. The rows of
    each; a failing statement raises, as Django's cursors do, and the ones after it do not
    run. The statements go through psycopg's cursors, so Django's execute wrappers (and its
    query log) do not see them."""
    with connection.cursor() as checked:  # Django's checks: connected, no broken atomic block
        pg = checked.cursor.connection
        with connection.wrap_database_errors:
            cursors = []
            try:
                with pg.pipeline():
                    for sql, params in statements:
                        cursor = pg.cursor()
                        cursors.append(cursor)
                        cursor.execute(sql, params)
                return [cursor.fetchall() if cursor.description else [] for cursor in cursors]
            finally:
                for cursor in cursors:
                    cursor.close()


def model_from_row(model: type[M], fields, values) -> M:
    """A model instance from its columns, with each field's converters applied, as the ORM's
    own reads do."""
    converted = [_converted(field, value) for field, value in zip(fields, values, strict=True)]
    return model.from_db(connection.alias, [f.attname for f in fields], converted)


def _db_default_literal(field, value):
    """A field left to a constant `db_default` (no Python default) is written that constant,
    the value the column's DEFAULT would give: a DEFAULT keyword would need the ORM's compiler,
    which cost a create more CPU than its two INSERTs (bench/scheduler.py)."""
    if not isinstance(value, DatabaseDefault):
        return value
    default = field.db_default
    if isinstance(default, Value):
        return default.value
    return value if hasattr(default, "resolve_expression") else default


def _converted(field, value):
    for converter in field.get_db_converters(connection):
        value = converter(value, field, connection)
    return value


class _Names:
    """One model's names for an SQL template: `{x}` is its table, `{x.field}` a field's column
    (by field name or attname); a name the model lacks raises when the statement is built."""

    __slots__ = ("_model_meta",)

    def __init__(self, model: type[models.Model]):
        self._model_meta = model._meta

    def __format__(self, spec: str) -> str:
        return connection.ops.quote_name(self._model_meta.db_table)

    def __getattr__(self, name: str) -> str:
        return connection.ops.quote_name(self._model_meta.get_field(name).column)


def sql_named(template: str, **tables: type[models.Model]) -> str:
    """`template` with each model's names filled in from its `_meta`: `{rental}` the quoted
    table of tables["rental"], `{rental.team}` the column of its field (braces of the SQL
    itself doubled). Build a statement once per process (functools.cache) and keep it."""
    return template.format(**{key: _Names(model) for key, model in tables.items()})


# psycopg keeps a statement's parsed text (where its parameters are) for statements up to this
# long (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH) and parses a longer one again each time.
PARSED_TEXT_CACHED_CHARS = 4096


def sql_compact(sql: str) -> str:
    """`sql` without its indentation and its comment lines, for a statement run on a hot path
    that would otherwise be longer than PARSED_TEXT_CACHED_CHARS (no string literal of ours
    spans lines)."""
    lines = (line.strip() for line in sql.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("--"))
