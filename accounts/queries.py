"""The accounts app's hand-written SQL, each statement here and nowhere else in the app.

Written by hand because a `bench/` script shows the ORM's version costing more (the comment
above it names the figure). Names come from the models' `_meta` (core.rows.sql_named), the
statement built once per process; tests/accounts/test_queries.py asks its question again
through the ORM.
"""

from __future__ import annotations

from functools import cache

from django.contrib.auth import get_user_model
from django.db import connection

from accounts.models import ApiToken, Membership, Team
from core.rows import model_from_row, sql_named

User = get_user_model()


def _all(sql: str, params) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


# --- The create path --------------------------------------------------------------------------
# Every request with a token reads it, its user and team and the user's membership of that
# team; Django compiling that join cost more CPU than anything else in a create (a create's
# server CPU, bench/scheduler.py --parts api, docs/benchmarks.md), so the statement is built
# once and the rows are made into models as the ORM does.
_TOKEN_JOIN = ((ApiToken, "t"), (User, "u"), (Team, "tm"), (Membership, "m"))


@cache
def _token_sql() -> str:
    quote = connection.ops.quote_name
    columns = ", ".join(
        f"{alias}.{quote(field.column)}"
        for model, alias in _TOKEN_JOIN
        for field in model._meta.concrete_fields
    )
    return sql_named(
        f"SELECT {columns} FROM {{token}} t"  # noqa: S608 - the models' own names
        " JOIN {user} u ON u.{user.id} = t.{token.user}"
        " JOIN {team} tm ON tm.{team.id} = t.{token.team}"
        " LEFT JOIN {membership} m"
        " ON m.{membership.team} = t.{token.team} AND m.{membership.user} = t.{token.user}"
        " WHERE t.{token.key_hash} = %s",
        token=ApiToken,
        user=User,
        team=Team,
        membership=Membership,
    )


def api_token_with_membership(
    *, key_hash: str
) -> tuple[ApiToken, User, Team, Membership | None] | None:
    """The token with that hash, its user, its team and the user's membership of the team
    (None when they are no longer in it), in one statement; None for no such token."""
    rows = _all(_token_sql(), [key_hash])
    if not rows:
        return None
    row = rows[0]
    loaded = []
    for model, _ in _TOKEN_JOIN:
        fields = model._meta.concrete_fields
        values, row = row[: len(fields)], row[len(fields) :]
        loaded.append(model_from_row(model, fields, values) if values[0] is not None else None)
    token, user, team, membership = loaded
    return token, user, team, membership
