"""The billing pass: rate usage, post charges to the ledger, warn and stop at zero balance.

Rating and posting are one set-based statement per chunk of meters, so a pass over 100,000
running rentals is a handful of statements, not 100,000 round trips:

1. rate: for each meter with new reports (or whose rental moved), GPU-seconds to date = the sum
   over the GPUs allocated to the rental on that node of |confirmed ∩ held ∩ running|, where
   confirmed is the union of the node's confirmed spans, held the GPU's allocation range (cut
   at its release) and running the rental's RUNNING episodes from its events (a stop counts
   for the agent's stop grace at most). Whatever an agent confirms, no second outside what the
   server authorised is billed;
   charge to date = floor(GPU-seconds x locked price / 3600) in micro-dollars. Computed from
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
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db import connection, transaction
from django.utils import timezone

from agentprotocol import DEFAULT_STOP_GRACE_S
from billing import conf
from billing.models import Account, AccountKind, BalanceNotice, NoticeKind
from billing.services.budgets import budgets_enforce
from billing.services.ledger import account_platform
from core.locks import advisory_lock
from marketplace import lifecycle
from marketplace.models import Rental
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


# Meters whose usage changed, or whose charge is not fully posted; everything below reads these.
_CANDIDATES = """
    SELECT m.id, m.rental_id, m.node_id, m.fee_bps, m.usage_version, m.gpu_seconds,
           m.charge_micros, m.posting_seq, m.posted_gpu_seconds, m.posted_charge_micros,
           m.posted_earning_micros, m.posted_at,
           coalesce(m.price_per_gpu_hour, r.price_per_gpu_hour) AS price_per_gpu_hour,
           -- Rated again on a new report, and when the rental moved (a stop, an end, a
           -- release): those can only shorten what may be billed.
           ((m.rated_version < m.usage_version OR r.updated_at > m.rated_at)
            AND coalesce(m.price_per_gpu_hour, r.price_per_gpu_hour) IS NOT NULL) AS dirty,
           r.started_at, r.ended_at, r.status, r.team_id, n.provider_id
    FROM billing_usagemeter m
    JOIN marketplace_rental r ON r.id = m.rental_id
    JOIN marketplace_node n ON n.id = m.node_id
    WHERE m.id >= %(first_id)s AND m.id < %(end_id)s
      AND (m.rated_version < m.usage_version OR r.updated_at > m.rated_at
           OR m.charge_micros <> m.posted_charge_micros)
"""

_ENSURE_ACCOUNTS_SQL = f"""
WITH c AS ({_CANDIDATES}),
customers AS (
    INSERT INTO billing_account (kind, team_id, balance_micros, stripe_customer_id,
                                 stripe_connect_account_id, created_at)
    SELECT 'customer', u.team_id, 0, '', '', %(now)s
    FROM (SELECT DISTINCT team_id FROM c) u
    WHERE NOT EXISTS (SELECT 1 FROM billing_account a
                      WHERE a.kind = 'customer' AND a.team_id = u.team_id)
    ON CONFLICT DO NOTHING
    RETURNING id
)
INSERT INTO billing_account (kind, provider_id, balance_micros, stripe_customer_id,
                             stripe_connect_account_id, created_at)
SELECT 'provider', p.provider_id, 0, '', '', %(now)s
FROM (SELECT DISTINCT provider_id FROM c) p
WHERE NOT EXISTS (SELECT 1 FROM billing_account a
                  WHERE a.kind = 'provider' AND a.provider_id = p.provider_id)
ON CONFLICT DO NOTHING
"""  # noqa: S608 - a constant fragment, no user text

_PASS_SQL = f"""
WITH c AS ({_CANDIDATES}),
confirmed AS (
    -- The union of the runs' confirmed spans: two runs that overlap (a restart confirmed
    -- late) never bill the same second twice.
    SELECT c.id, max(s.gpu_count) AS gpus,
           range_agg(tstzrange(s.started_at, s.confirmed_until)) AS spans
    FROM c JOIN billing_usagesegment s ON s.rental_id = c.rental_id AND s.node_id = c.node_id
    WHERE c.dirty
    GROUP BY c.id
),
moves AS (
    SELECT ev.rental_id, ev.to_status, ev.created_at, c.started_at, c.ended_at,
           lag(ev.created_at) OVER w AS prev_at,
           lead(ev.to_status) OVER w AS next_to,
           lead(ev.created_at) OVER w AS next_at,
           lead(ev.created_at, 2) OVER w AS after_next_at
    FROM (SELECT DISTINCT rental_id, started_at, ended_at FROM c WHERE dirty) c
    JOIN marketplace_rentalevent ev ON ev.rental_id = c.rental_id
    WINDOW w AS (PARTITION BY ev.rental_id ORDER BY ev.created_at, ev.id)
),
episodes AS (
    -- Each time the rental was RUNNING, in the server's own event times: from the agent's
    -- start (no earlier than the hand-over before it) to the next move; a stop counts for its
    -- grace at most, so a stop that never reaches the agent stops the bill anyway.
    SELECT rental_id, lo, GREATEST(lo, hi) AS hi
    FROM (SELECT rental_id,
                 GREATEST(prev_at, LEAST(created_at, started_at)) AS lo,
                 LEAST(CASE WHEN next_to = 'stopping'
                            THEN LEAST(next_at + %(grace)s, coalesce(after_next_at, 'infinity'))
                            ELSE coalesce(next_at, 'infinity') END,
                       coalesce(ended_at, 'infinity')) AS hi
          FROM moves WHERE to_status = 'running') e
),
running AS (
    SELECT rental_id, range_agg(tstzrange(lo, hi)) AS spans FROM episodes GROUP BY rental_id
),
held AS (
    -- The allocations on the meter's node, each GPU's range (cut at its release). GPUs placed
    -- together share a range; the agent's GPU count caps how many of them are billed.
    SELECT c.id, c.rental_id, a.during,
           row_number() OVER (PARTITION BY c.id, a.during ORDER BY a.gpu_id) AS nth
    FROM c JOIN marketplace_allocation a ON a.rental_id = c.rental_id AND a.node_id = c.node_id
    WHERE c.dirty
),
used AS (
    -- Billable: confirmed, inside the allocation held on this node, while the rental ran.
    SELECT h.id, sum(floor(extract(epoch FROM (
               SELECT sum(upper(x) - lower(x))
               FROM unnest(k.spans * tstzmultirange(h.during) * ru.spans) AS x))))::bigint
               AS gpu_seconds
    FROM held h
    JOIN confirmed k ON k.id = h.id
    JOIN running ru ON ru.rental_id = h.rental_id
    WHERE h.nth <= k.gpus
    GROUP BY h.id
),
rated AS (
    SELECT c.*, ca.id AS customer_account_id, pa.id AS provider_account_id,
           CASE WHEN c.dirty THEN coalesce(used.gpu_seconds, 0) ELSE c.gpu_seconds END
               AS new_seconds,
           CASE WHEN c.dirty
                THEN div(coalesce(used.gpu_seconds, 0) * c.price_per_gpu_hour * 1000000,
                         3600)::bigint
                ELSE c.charge_micros END AS new_charge
    FROM c
    LEFT JOIN used ON used.id = c.id
    LEFT JOIN billing_account ca ON ca.kind = 'customer' AND ca.team_id = c.team_id
    LEFT JOIN billing_account pa ON pa.kind = 'provider' AND pa.provider_id = c.provider_id
),
decided AS (
    SELECT r.*,
           div(r.new_charge::numeric * (10000 - r.fee_bps), 10000)::bigint AS new_earning,
           (r.new_charge <> r.posted_charge_micros
            AND r.customer_account_id IS NOT NULL AND r.provider_account_id IS NOT NULL
            AND (r.posted_at IS NULL
                 OR r.posted_at <= %(cutoff)s
                 OR r.posted_at < %(month_start)s
                 OR r.status = ANY(%(terminal)s))) AS post
    FROM rated r
),
moved AS (
    -- The pass is the only writer of these columns (one pass at a time), so the values read
    -- above are still current; a report racing this statement only moves usage_version,
    -- which stays ahead of rated_version and is rated next pass.
    UPDATE billing_usagemeter m
    SET gpu_seconds = d.new_seconds,
        charge_micros = d.new_charge,
        rated_version = CASE WHEN d.dirty THEN d.usage_version ELSE m.rated_version END,
        rated_at = CASE WHEN d.dirty THEN %(now)s ELSE m.rated_at END,
        posting_seq = d.posting_seq + d.post::int,
        posted_gpu_seconds = CASE WHEN d.post THEN d.new_seconds ELSE d.posted_gpu_seconds END,
        posted_charge_micros = CASE WHEN d.post THEN d.new_charge ELSE d.posted_charge_micros END,
        posted_earning_micros = CASE WHEN d.post THEN d.new_earning
                                     ELSE d.posted_earning_micros END,
        posted_at = CASE WHEN d.post THEN %(now)s ELSE d.posted_at END
    FROM decided d
    WHERE m.id = d.id AND (d.dirty OR d.post)
    RETURNING m.id
),
entries AS (
    -- The deltas since the last posting, from totals: usage + earning + fee = 0.
    INSERT INTO billing_ledgerentry
        (account_id, kind, amount_micros, rental_id, meter_id, posting_seq, gpu_seconds, memo,
         created_at)
    SELECT v.account_id, v.kind, v.amount, d.rental_id, d.id, d.posting_seq + 1, v.seconds, '',
           %(now)s
    FROM decided d CROSS JOIN LATERAL (VALUES
        (d.customer_account_id, 'usage', d.posted_charge_micros - d.new_charge,
         d.new_seconds - d.posted_gpu_seconds),
        (d.provider_account_id, 'earning', d.new_earning - d.posted_earning_micros,
         NULL::bigint),
        (%(platform)s::bigint, 'platform_fee',
         (d.new_charge - d.posted_charge_micros) - (d.new_earning - d.posted_earning_micros),
         NULL::bigint)
    ) AS v(account_id, kind, amount, seconds)
    WHERE d.post AND v.amount <> 0
    RETURNING account_id, amount_micros
),
balances AS (
    UPDATE billing_account a SET balance_micros = a.balance_micros + t.total
    FROM (SELECT account_id, sum(amount_micros) AS total FROM entries GROUP BY account_id) t
    WHERE a.id = t.account_id
    RETURNING a.id
)
SELECT (SELECT count(*) FROM decided WHERE dirty), (SELECT count(*) FROM decided WHERE post),
       (SELECT count(*) FROM entries), (SELECT count(*) FROM balances), (SELECT count(*) FROM moved)
"""  # noqa: S608 - a constant fragment, no user text

# Teams with money at stake: a running rental, accrued usage, or a flag to clear.
_POSITIONS_SQL = """
WITH burn AS (
    SELECT team_id,
           sum(round(price_per_gpu_hour * 1000000) * gpus_per_node * node_count)::bigint
               AS micros_per_hour
    FROM marketplace_rental
    WHERE status = ANY(%(burning)s) AND price_per_gpu_hour IS NOT NULL
    GROUP BY team_id
),
accrued AS (
    SELECT r.team_id, sum(m.charge_micros - m.posted_charge_micros)::bigint AS micros
    FROM billing_usagemeter m JOIN marketplace_rental r ON r.id = m.rental_id
    WHERE m.charge_micros <> m.posted_charge_micros
    GROUP BY r.team_id
),
who AS (
    SELECT team_id FROM burn
    UNION SELECT team_id FROM accrued
    UNION SELECT team_id FROM billing_account
          WHERE kind = 'customer'
            AND (low_balance_since IS NOT NULL OR depleted_since IS NOT NULL)
)
SELECT who.team_id, a.id,
       coalesce(a.balance_micros, 0) - coalesce(accrued.micros, 0) AS available,
       coalesce(burn.micros_per_hour, 0) AS burn,
       a.low_balance_since IS NOT NULL, a.depleted_since IS NOT NULL
FROM who
LEFT JOIN billing_account a ON a.kind = 'customer' AND a.team_id = who.team_id
LEFT JOIN burn ON burn.team_id = who.team_id
LEFT JOIN accrued ON accrued.team_id = who.team_id
"""


# Meters per statement: each chunk is its own transaction, so a heartbeat that reports usage
# waits for at most one chunk's row locks (well under a second), not for the whole pass.
CHUNK = 25_000


def meters_rate_and_post(*, now: datetime, chunk: int = CHUNK) -> tuple[int, int, int]:
    """Steps 1 and 2, one statement per chunk of meters: rate the meters with new reports,
    post those due. Returns (meters rated, meters posted, ledger entries)."""
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
    }
    with connection.cursor() as cursor:
        cursor.execute("SELECT coalesce(min(id), 0), coalesce(max(id), -1) FROM billing_usagemeter")
        low, high = cursor.fetchone()
    with connection.cursor() as cursor:
        cursor.execute(_ENSURE_ACCOUNTS_SQL, {**params, "first_id": low, "end_id": high + 1})
    rated = posted = entries = 0
    for first_id in range(low, high + 1, chunk):
        ids = {**params, "first_id": first_id, "end_id": first_id + chunk}
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(_PASS_SQL, ids)
            r, p, e, _, _ = cursor.fetchone()
        rated, posted, entries = rated + r, posted + p, entries + e
    return rated, posted, entries


def _usd(micros: int) -> str:
    return f"${Decimal(micros) / conf.MICROS_PER_USD:.2f}"


def balances_enforce(*, now: datetime, result: BillingPassResult) -> None:
    """Step 3: low-balance notices, and at zero stop the team's rentals."""
    with connection.cursor() as cursor:
        cursor.execute(_POSITIONS_SQL, {"burning": [str(s) for s in lifecycle.BURNING]})
        positions = cursor.fetchall()
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


def billing_pass_run(*, now: datetime | None = None, chunk: int = CHUNK) -> BillingPassResult:
    """Rate, post and enforce once; skipped when another pass holds the lock."""
    result = BillingPassResult()
    with advisory_lock("billing:pass") as got:
        if not got:
            return result
        result.ran = True
        now = now or timezone.now()
        t0 = time.perf_counter()
        result.meters_rated, result.meters_posted, result.entries = meters_rate_and_post(
            now=now, chunk=chunk
        )
        t1 = time.perf_counter()
        balances_enforce(now=now, result=result)
        t2 = time.perf_counter()
        budgets = budgets_enforce(now=now)
        result.budget_warnings, result.budgets_reached = budgets.warned, budgets.reached
        result.rentals_stopped += budgets.rentals_stopped
        t3 = time.perf_counter()
        result.seconds = {"rate_and_post": t1 - t0, "enforce": t2 - t1, "budgets": t3 - t2}
    log.info("billing pass: %s", result)
    return result
