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

import psycopg
from django.db import connection, models
from django.db.models.expressions import DatabaseDefault, Value

M = TypeVar("M", bound=models.Model)


@cache
def _insert_statement(model: type[models.Model]) -> tuple[str, tuple, tuple]:
    """The INSERT of one row of `model`: its SQL, the fields it writes, the fields it returns.
    The fields are those Model.save() inserts when the auto primary key is left to the
    database."""
    fields, returning = _insert_fields(model)
    return _insert_sql(model, fields, returning, ["%s"] * len(fields)), fields, returning


def _insert_fields(model: type[models.Model]) -> tuple[tuple, tuple]:
    meta = model._meta
    if meta.parents or meta.order_with_respect_to:
        raise TypeError(f"{model.__name__}: multi-table or ordered models are not inserted here")
    fields = tuple(
        f for f in meta.local_concrete_fields if not f.generated and f is not meta.auto_field
    )
    return fields, tuple(meta.db_returning_fields)


def _insert_sql(model: type[models.Model], fields, returning, placeholders: list[str]) -> str:
    quote = connection.ops.quote_name
    columns = ", ".join(quote(f.column) for f in fields)
    table = quote(model._meta.db_table)
    sql = f"INSERT INTO {table} ({columns}) VALUES ({', '.join(placeholders)})"  # noqa: S608
    if returning:
        sql += f" RETURNING {', '.join(quote(f.column) for f in returning)}"
    return sql


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


@cache
def _chained_insert_statement(models_: tuple[type[models.Model], ...]) -> tuple[str, tuple]:
    """One statement inserting a row of each model in turn (a data-modifying WITH per row),
    answering every row's returned columns in one row; and each model's insert fields and
    returned fields, in order."""
    quote = connection.ops.quote_name
    steps, selected, shapes = [], [], []
    numbered = 0
    for i, model in enumerate(models_):
        fields, returning = _insert_fields(model)
        # Numbered ($n) placeholders, sent as they are (a raw cursor): psycopg converts `%s`
        # anew on every call for a statement of more than 50 parameters, which a rental's
        # columns and its event's are.
        placeholders = [f"${numbered + k + 1}" for k in range(len(fields))]
        numbered += len(fields)
        sql = _insert_sql(model, fields, returning, placeholders)
        steps.append(f"_row{i} AS ({sql if returning else sql + ' RETURNING 1'})")
        selected += [f"_row{i}.{quote(f.column)}" for f in returning]
        shapes.append((fields, returning))
    sources = ", ".join(f"_row{i}" for i in range(len(models_)))
    sql = f"WITH {', '.join(steps)} SELECT {', '.join(selected) or '1'} FROM {sources}"  # noqa: S608
    return sql, tuple(shapes)


def models_insert(*objs: models.Model) -> None:
    """Insert new, unsaved instances (a row each, in order: a later one may point at an
    earlier one, whose key is set in Python) as model_insert does, in one prepared statement:
    a create writes its rental and its first event in one round trip instead of two."""
    sql, shapes = _chained_insert_statement(tuple(type(obj) for obj in objs))
    params: list = []
    for obj, (fields, _) in zip(objs, shapes, strict=True):
        meta = obj._meta
        if meta.auto_field is not None and getattr(obj, meta.auto_field.attname) is not None:
            raise ValueError(f"{type(obj).__name__}: its auto primary key is already set")
        values = insert_values(obj, fields)
        if values is None:  # an expression: only the ORM's compiler writes it
            for each in objs:
                model_insert(each)
            return
        params += values
    # A raw cursor of the connection, as pipelined uses psycopg's own: Django's query log does
    # not see the statement, Django's error types are still raised.
    with (
        connection.cursor() as checked,
        connection.wrap_database_errors,
        psycopg.RawCursor(checked.cursor.connection) as cursor,
    ):
        cursor.execute(sql, params)
        row = cursor.fetchone()
    returned = iter(row)
    for obj, (_, returning) in zip(objs, shapes, strict=True):
        for field in returning:
            setattr(obj, field.attname, _converted(field, next(returned)))
        mark_saved(obj)


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


def pipelined(
    statements: Sequence[tuple[str, Sequence]], *, raw: bool = False
) -> list[list[tuple]]:
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


def filters_set(params: dict, names, *, nullable=()) -> frozenset[str]:
    """Which of the optional filters `names` `params` sets, for a statement built with a clause
    per filter set (one statement per combination, each planned for itself: a clause written
    `(%(x)s IS NULL OR ...)` lets PostgreSQL's generic plan of a prepared statement guess one
    row and read everything, marketplace.queries). A `nullable` filter is set when it is not
    None (a price of 0 filters), any other when it is not false, zero or empty."""
    return frozenset(
        name
        for name in names
        if (params.get(name) is not None if name in nullable else params.get(name))
    )


# psycopg keeps a statement's parsed text (where its parameters are) for statements up to this
# long (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH) and parses a longer one again each time.
PARSED_TEXT_CACHED_CHARS = 4096


def sql_compact(sql: str) -> str:
    """`sql` without its indentation and its comment lines, for a statement run on a hot path
    that would otherwise be longer than PARSED_TEXT_CACHED_CHARS (no string literal of ours
    spans lines)."""
    lines = (line.strip() for line in sql.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("--"))
