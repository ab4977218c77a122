"""The billing pass: rate usage, post charges to the ledger, warn and stop at zero balance.

Rating and posting are set-based statements over chunks of meters, so a pass over 100,000
running rentals is a handful of statements, not 100,000 round trips. Rating reads and locks
nothing it writes (its rows go to a temporary table of the pass); posting writes a chunk of
meters, their entries and the balances per transaction (billing.queries says how):

1. rate: for each meter with new reports (or whose rental moved), GPU-seconds to date = the sum
   over the GPUs allocated to the rental on that node of |confirmed ∩ held ∩ running|, where
   confirmed is the union of the node's confirmed spans, held the GPU's allocation range (cut
   at its release) and running the rental's RUNNING episodes from its events (a stop counts
   for the agent's stop grace at most). Whatever an agent confirms, no second outside what the
   server authorised is billed;
   charge to date = floor(GPU-seconds x locked price / 3600) in micro-dollars (core.money). From
   totals every time, never by adding rounded increments, so rounding cannot drift.
2. post: for meters due (hourly, at the end of the rental, or at a month boundary), append the
   deltas since the last posting: the customer's usage debit, the provider's earning and the
   platform's fee, which sum to zero; keyed by (meter, posting_seq, kind), so nothing is
   posted twice. Postings are hourly rather than every pass to keep the ledger at a few
   million rows a day at full scale; between postings the accrued charge (rated, not yet
   posted) counts against the available balance.
3. enforce: available = balance - accrued. Below one hour of the customer's running rentals:
   a low-balance notice; at zero: the rentals are stopped (the agent checkpoints on STOPPING).
4. budgets: rentals at their own cap, and accounts at their monthly budget, are stopped the
   same way (billing.services.budgets, which states how far past a cap a charge can go).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Max, Min
from django.utils import timezone

from agentprotocol import DEFAULT_STOP_GRACE_S
from billing import conf, queries
from billing.models import Account, AccountKind, BalanceNotice, NoticeKind, UsageMeter
from billing.services.budgets import budgets_enforce
from billing.services.ledger import account_platform
from core.locks import advisory_lock
from marketplace import lifecycle
from marketplace.models import Rental, RentalStatus
from notifications.services import balance_low_notify

log = logging.getLogger(__name__)


@dataclass
class BillingPassResult:
    """What one pass did, for logs, tests and the benchmark."""

    ran: bool = False
    meters_rated: int = 0
    meters_posted: int = 0
    entries: int = 0
    low_balance: int = 0
    depleted: int = 0
    restored: int = 0
    rentals_stopped: int = 0
    budget_warnings: int = 0
    budgets_reached: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


# Meters per rating statement: each reads the usage, allocations and events whole (hash joins),
# so fewer, larger statements cost less; it locks nothing.
RATE_CHUNK = 100_000
# Meters per posting transaction: a heartbeat that reports usage waits for at most one chunk's
# row locks, not for the whole pass.
CHUNK = 25_000


def _chunked(
    first: int, end: int, chunk: int, run: Callable[[int, int], Sequence[int]], what: str
) -> list[int]:
    """`run(first, end)` over [first, end) in chunks of `chunk`, each in its own transaction
    (savepoint), the sum of what they return. A chunk that runs out of time is rolled back
    whole and put back as two halves, so a pass over more meters than one statement can do in
    its time still does them all, in smaller statements; a single one that cannot is left for
    the next pass, which rates it from its totals as if never missed."""
    totals: list[int] = []
    todo = [(lo, min(lo + chunk, end)) for lo in range(first, end, chunk)]
    todo.reverse()
    while todo:
        lo, hi = todo.pop()
        try:
            with transaction.atomic():
                counts = run(lo, hi)
        except queries.ChunkTimedOut:
            if hi - lo <= 1:
                log.error("billing pass: %s %s not done in time; next pass", what, lo)
                continue
            middle = (lo + hi) // 2
            log.warning(
                "billing pass: %s %s-%s ran out of time; doing them in halves", what, lo, hi - 1
            )
            todo += [(middle, hi), (lo, middle)]
            continue
        totals = [a + b for a, b in zip(totals or [0] * len(counts), counts, strict=True)]
    return totals


# The moves rating reads from a rental's events: RUNNING, and every move that can follow it or
# the stop that follows it (what ends an episode, or its stop's grace).
_EPISODE_MOVES = frozenset(
    {
        str(s)
        for s in (
            RentalStatus.RUNNING,
            *lifecycle.ALLOWED_TRANSITIONS[RentalStatus.RUNNING],
            *lifecycle.ALLOWED_TRANSITIONS[RentalStatus.STOPPING],
        )
    }
)


def meters_rate_and_post(
    *, now: datetime, chunk: int | None = None, seconds: dict[str, float] | None = None
) -> tuple[int, int, int]:
    """Steps 1 and 2: rate the meters with new reports (a statement per chunk of meter ids),
    then write them and post those due (a transaction per chunk, by team). Returns (meters
    rated, meters posted, ledger entries). `chunk` sets both chunk sizes (tests)."""
    platform = account_platform()
    params = {
        "now": now,
        "cutoff": now - timedelta(seconds=conf.posting_interval_s()),
        "month_start": now.astimezone(UTC).replace(
            day=1, hour=0, minute=0, second=0, microsecond=0
        ),
        "terminal": [str(s) for s in lifecycle.TERMINAL],
        "platform": platform.pk,
        "grace": timedelta(seconds=DEFAULT_STOP_GRACE_S),
        "moves": sorted(_EPISODE_MOVES),
    }
    timeout_ms = conf.chunk_timeout_ms()
    bounds = UsageMeter.objects.aggregate(low=Min("id"), high=Max("id"))
    low = bounds["low"] if bounds["low"] is not None else 0
    high = bounds["high"] if bounds["high"] is not None else -1
    t0 = time.perf_counter()
    queries.billing_pass_tables_create()
    _chunked(
        low,
        high + 1,
        chunk or RATE_CHUNK,
        lambda first, end: [
            queries.meters_rate(
                params={**params, "first_id": first, "end_id": end}, timeout_ms=timeout_ms
            )
        ],
        "meters",
    )
    queries.billing_accounts_ensure(params=params)
    decided = queries.meters_decide(params=params)
    t1 = time.perf_counter()
    totals = _chunked(
        1,
        decided + 1,
        chunk or CHUNK,
        lambda first, end: queries.meters_post(
            params={**params, "first_k": first, "end_k": end}, timeout_ms=timeout_ms
        ),
        "postings",
    )
    # Left behind on an error: the next pass's create drops them, as does the session's end.
    queries.billing_pass_tables_drop()
    if seconds is not None:
        seconds.update(rate=t1 - t0, post=time.perf_counter() - t1)
    rated, posted, entries = totals or [0, 0, 0]
    return rated, posted, entries


def _usd(micros: int) -> str:
    return f"${Decimal(micros) / conf.MICROS_PER_USD:.2f}"


def balances_enforce(*, now: datetime, result: BillingPassResult) -> None:
    """Step 3: low-balance notices, and at zero stop the team's rentals."""
    positions = queries.team_positions(burning=[str(s) for s in lifecycle.BURNING])
    hours = conf.low_balance_hours()
    for team_id, account_id, available, burn, was_low, was_depleted in positions:
        depleted = available <= 0
        low = depleted or (burn > 0 and available < burn * hours)
        if (low, depleted) != (was_low, was_depleted):
            _account_flags_set(
                team_id=team_id,
                account_id=account_id,
                now=now,
                available=available,
                burn=burn,
                low=low,
                depleted=depleted,
                result=result,
            )
        if depleted:
            result.rentals_stopped += _rentals_stop(team_id=team_id, available=available)


def _account_flags_set(
    *,
    team_id: int,
    account_id: int | None,
    now: datetime,
    available: int,
    burn: int,
    low: bool,
    depleted: bool,
    result: BillingPassResult,
) -> None:
    """Move the account's flags and record a notice for each change, in one transaction."""
    with transaction.atomic():
        if account_id is None:
            # Rentals run without an account only when the funds check is off.
            account_id = Account.objects.get_or_create(kind=AccountKind.CUSTOMER, team_id=team_id)[
                0
            ].pk
        account = Account.objects.select_for_update().get(pk=account_id)
        was_flagged = account.low_balance_since is not None or account.depleted_since is not None
        notices = []
        if low and account.low_balance_since is None:
            account.low_balance_since = now
            result.low_balance += 1
            notices.append(
                (
                    NoticeKind.LOW_BALANCE,
                    f"{_usd(available)} covers less than {conf.low_balance_hours()} h of "
                    f"running rentals ({_usd(burn)}/h)",
                )
            )
        if depleted and account.depleted_since is None:
            account.depleted_since = now
            result.depleted += 1
            notices.append(
                (NoticeKind.DEPLETED, f"balance {_usd(available)}: rentals are being stopped")
            )
        if not low:
            account.low_balance_since = None
        if not depleted:
            account.depleted_since = None
        if was_flagged and not low and not depleted:
            result.restored += 1
            notices.append((NoticeKind.RESTORED, f"balance {_usd(available)}"))
        account.save(update_fields=["low_balance_since", "depleted_since"])
        created = BalanceNotice.objects.bulk_create(
            BalanceNotice(
                account=account,
                kind=kind,
                available_micros=available,
                hourly_burn_micros=burn,
                detail=detail,
                created_at=now,
            )
            for kind, detail in notices
        )
        for notice in created:
            if notice.kind in (NoticeKind.LOW_BALANCE, NoticeKind.DEPLETED):
                balance_low_notify(
                    team=account.team,
                    notice_id=notice.pk,
                    detail=notice.detail,
                    available_micros=available,
                    hourly_burn_micros=burn,
                )


def _rentals_stop(*, team_id: int, available: int) -> int:
    """Stop every rental of the team that still holds or waits for GPUs."""
    stopped = 0
    reason = f"balance exhausted (available {_usd(available)}): top up to rent again"
    for rental_id in (
        Rental.objects.filter(team_id=team_id, status__in=lifecycle.STOPPABLE)
        .order_by("created_at")
        .values_list("pk", flat=True)
    ):
        if lifecycle.rental_stop_for_funds(rental_id=rental_id, reason=reason):
            stopped += 1
    return stopped


def billing_pass_run(*, now: datetime | None = None, chunk: int | None = None) -> BillingPassResult:
    """Rate, post and enforce once; skipped when another pass holds the lock."""
    result = BillingPassResult()
    with advisory_lock("billing:pass") as got:
        if not got:
            return result
        result.ran = True
        now = now or timezone.now()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        result.meters_rated, result.meters_posted, result.entries = meters_rate_and_post(
            now=now, chunk=chunk, seconds=phases
        )
        t1 = time.perf_counter()
        balances_enforce(now=now, result=result)
        t2 = time.perf_counter()
        budgets = budgets_enforce(now=now)
        result.budget_warnings, result.budgets_reached = budgets.warned, budgets.reached
        result.rentals_stopped += budgets.rentals_stopped
        t3 = time.perf_counter()
        result.seconds = {
            "rate_and_post": t1 - t0,
            **phases,
            "enforce": t2 - t1,
            "budgets": t3 - t2,
        }
    log.info("billing pass: %s", result)
    return result
