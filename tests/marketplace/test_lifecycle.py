"""The lifecycle is the only writer of a rental's status and events: a scan of the source
tree for every other way of writing them, and the scan shown to catch the writers it replaced."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError

from marketplace.lifecycle import rental_transition
from marketplace.models import Rental, RentalEvent, RentalStatus

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (
    "marketplace", "scheduler", "provisioning", "billing", "notifications", "config", "core",
    "advisor", "storage",
)  # fmt: skip
_TABLES = {"Rental": "marketplace_rental", "RentalEvent": "marketplace_rentalevent"}
LIFECYCLE = ROOT / "marketplace" / "lifecycle.py"

_UPDATE_RENTAL = re.compile(
    r"\bUPDATE\s+marketplace_rental\b(?!event).*?\bSET\b(?P<set>.*?)(?:\bFROM\b|\bWHERE\b|\bRETURNING\b|$)",
    re.IGNORECASE | re.DOTALL,
)
_WRITE_EVENT = re.compile(r"\b(INSERT\s+INTO|COPY)\s+marketplace_rentalevent\b", re.IGNORECASE)
_MANAGER_WRITES = {"create", "bulk_create", "get_or_create", "update_or_create"}


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def _about_rentals(node: ast.AST) -> bool:
    """The expression names a rental: `rental`, `self.rental`, `Rental.objects.filter(...)`."""
    return "rental" in _text(node).lower()


def _sql(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "?" for v in node.values)
    return None


def rental_status_writes(source: str, filename: str = "<source>") -> list[str]:
    """Every place in `source` that writes a rental's status or an event row itself."""
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    tree = ast.parse(source, filename)
    # Statements written with names from `_meta` (core.rows.sql_named(template, rental=Rental)):
    # `{rental}` is read as the table, `{rental.status}` as the column.
    aliases = {
        k.arg: _TABLES[k.value.id]
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _text(n.func).endswith("sql_named")
        for k in n.keywords
        if k.arg and isinstance(k.value, ast.Name) and k.value.id in _TABLES
    }

    def named(sql: str) -> str:
        for alias, table in aliases.items():
            sql = re.sub(r"\{" + alias + r"\.(\w+)\}", r"\1", sql).replace(f"{{{alias}}}", table)
        return sql

    # An f-string is read whole; its literal parts are not read again on their own.
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == "status"
                    and (_about_rentals(target.value) or "RentalStatus" in _text(node.value))
                ):
                    flag(node, f"assigns {_text(target)}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            keywords = {k.arg for k in node.keywords}
            receiver = func.value if isinstance(func, ast.Attribute) else func
            if name == "rental_transition":
                flag(node, "calls rental_transition")
            elif name == "setattr" and len(node.args) >= 2:
                obj, attr = node.args[0], node.args[1]
                if _about_rentals(obj) and _sql(attr) == "status":
                    flag(node, f"setattr({_text(obj)}, 'status', ...)")
            elif name in {"update", *_MANAGER_WRITES} and "status" in keywords:
                if _about_rentals(receiver):
                    flag(node, f"{_text(func)}(status=...)")
            elif name == "bulk_update" and _about_rentals(receiver) and "'status'" in _text(node):
                flag(node, f"{_text(func)}(..., ['status'])")
            elif name == "Rental" and "status" in keywords:
                flag(node, "Rental(status=...)")
            if name in _MANAGER_WRITES and (
                _text(receiver).startswith("RentalEvent.") or _text(receiver).endswith(".events")
            ):
                flag(node, f"{_text(func)}(...) writes an event row")
            elif name == "RentalEvent":
                flag(node, "RentalEvent(...) builds an event row")
        sql = _sql(node) if isinstance(node, ast.Constant | ast.JoinedStr) else None
        if sql is not None and id(node) not in parts:
            sql = named(sql)
            for update in _UPDATE_RENTAL.finditer(sql):
                if re.search(r"\bstatus\s*=", update.group("set"), re.IGNORECASE):
                    flag(node, "SQL sets marketplace_rental.status")
            if _WRITE_EVENT.search(sql):
                flag(node, "SQL writes marketplace_rentalevent")
    return found


def _sources() -> list[Path]:
    return sorted(
        path
        for package in SCANNED
        for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts and path != LIFECYCLE
    )


def test_only_the_lifecycle_writes_a_rentals_status_or_events():
    # Given every module of the apps and the configuration but the lifecycle
    sources = _sources()
    assert len(sources) > 50
    # Then none of them writes a rental's status or an event row itself
    found = [
        hit
        for path in sources
        for hit in rental_status_writes(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_the_lifecycle_itself_is_seen_writing():
    """The scan is not blind: the one module allowed to write is flagged by it."""
    hits = rental_status_writes(LIFECYCLE.read_text())
    assert any("assigns rental.status" in h for h in hits)
    assert any("writes an event row" in h for h in hits)
    assert any("SQL sets marketplace_rental.status" in h for h in hits)
    assert any("SQL writes marketplace_rentalevent" in h for h in hits)


# Writers the lifecycle replaced, as they were (commit 6569b87).
OLD_RENTAL_SERVICES = """
def rental_transition(*, rental, to_status, actor_kind, actor=None, reason="", **fields):
    RentalEvent.objects.create(
        rental=rental, from_status=rental.status, to_status=to_status, actor_kind=actor_kind,
        actor=actor, reason=reason[:500],
    )
    rental.status = to_status
    rental.save(update_fields=["status", "status_reason", "updated_at", *fields])
"""
OLD_SCHEDULER_BIND = '''
def _bind_chunk(placements, now):
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            UPDATE marketplace_rental r
            SET status = %s, status_reason = %s, price_per_gpu_hour = v.price,
                scheduled_start = v.s, scheduled_end = v.e, updated_at = %s
            FROM (VALUES {", ".join(values)}) AS v(id, price, s, e)
            WHERE r.id = v.id AND r.status = %s
            RETURNING r.id
            """,
            [RentalStatus.SCHEDULED, "placed", bound_at, *params, RentalStatus.PENDING],
        )
    with connection.cursor() as cursor:
        raw = cursor.cursor
        with raw.copy(
            "COPY marketplace_rentalevent (rental_id, from_status, to_status, actor_kind,"
            " reason, created_at) FROM STDIN"
        ) as copy:
            pass
'''
OLD_PROVISIONING_NODE_LOST = """
def _node_lost(rental, node, now, policy):
    allocations_release(rental=rental, at=now)
    if rental.status == RentalStatus.STOPPING:
        rental_transition(
            rental=rental, to_status=RentalStatus.COMPLETED, actor_kind=A.SYSTEM, reason=reason,
            ended_at=now,
        )
"""
NAMED_STATUS_WRITE = """
SET_STATUS = "UPDATE {r} SET {r.status} = %s WHERE {r.id} = %s"
EVENT = "INSERT INTO {ev} ({ev.rental}) VALUES (%s)"
statement = sql_named(SET_STATUS, r=Rental)
other = rows.sql_named(EVENT, ev=RentalEvent)
"""
OLD_TEST_SHORTCUT = "Rental.objects.filter(pk=waiting.pk).update(status=RentalStatus.SCHEDULED)"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (OLD_RENTAL_SERVICES, ["writes an event row", "assigns rental.status"]),
        (
            OLD_SCHEDULER_BIND,
            ["SQL sets marketplace_rental.status", "SQL writes marketplace_rentalevent"],
        ),
        (OLD_PROVISIONING_NODE_LOST, ["calls rental_transition"]),
        (
            NAMED_STATUS_WRITE,
            ["SQL sets marketplace_rental.status", "SQL writes marketplace_rentalevent"],
        ),
        (OLD_TEST_SHORTCUT, ["update(status=...)"]),
    ],
    ids=[
        "rental-services",
        "scheduler-bind",
        "provisioning-node-lost",
        "named-sql",
        "queryset-update",
    ],
)
def test_the_scan_flags_the_writers_the_lifecycle_replaced(source, expected):
    hits = rental_status_writes(source)
    assert len(hits) == len(expected)
    assert all(sum(what in hit for hit in hits) == 1 for what in expected), hits


def test_the_scan_leaves_reads_reasons_and_other_statuses_alone():
    source = """
node.status = NodeStatus.OFFLINE
run.status = report.status
Node.objects.filter(pk=1).update(status=NodeStatus.ONLINE)
if rental.status in TERMINAL:
    pass
cursor.execute("UPDATE marketplace_rental r SET status_reason = v.reason WHERE r.status = %s")
cursor.execute("SELECT status FROM marketplace_rental")
"""
    assert rental_status_writes(source) == []


@pytest.mark.django_db(transaction=True)
def test_a_transition_outside_a_transaction_is_refused_and_changes_nothing(make_node, rent):
    # Given a pending rental, read without a lock
    make_node()
    rental = rent(gpus=1)
    # When it is moved outside any transaction: refused
    with pytest.raises(TransactionManagementError):
        rental_transition(rental=rental, to_status=RentalStatus.CANCELLED, actor_kind="ops")
    # Then nothing changed
    assert Rental.objects.get(pk=rental.pk).status == RentalStatus.PENDING
    assert list(RentalEvent.objects.filter(rental=rental).values_list("to_status", flat=True)) == [
        RentalStatus.PENDING
    ]
    # And inside one it moves
    with transaction.atomic():
        locked = Rental.objects.select_for_update().get(pk=rental.pk)
        rental_transition(rental=locked, to_status=RentalStatus.CANCELLED, actor_kind="ops")
    assert Rental.objects.get(pk=rental.pk).status == RentalStatus.CANCELLED
