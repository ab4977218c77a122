"""Every write of the notifications app: settings, the outbox, deliveries and their attempts.

The outbox: a Notification and its Delivery rows are written in the transaction of the fact
they report (the lifecycle calls `rental_event_record` in the transition's transaction, billing
calls `balance_low_notify` / `budget_reached_notify` in its own), and are queued after commit.
A delivery is attempted under its row lock, so however many times its task runs, a delivered
row is never sent again; the periodic sweep re-queues what a lost message or a retry left due.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import requests
from celery import current_app
from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction
from django.utils import timezone

from accounts.models import Team
from accounts.services import team_personal_ensure
from core.errors import ValidationFailed
from marketplace.models import Rental, RentalEvent, RentalStatus, User
from notifications import audience, webhooks
from notifications.models import (
    Channel,
    Delivery,
    DeliveryState,
    Notification,
    NotificationKind,
    NotificationSettings,
)

K = NotificationKind
DELIVER_TASK = "notifications.deliver"

log = logging.getLogger(__name__)

_KIND_BY_STATUS = {
    RentalStatus.RUNNING: K.RENTAL_STARTED,
    RentalStatus.FAILED: K.RENTAL_FAILED,
    RentalStatus.PREEMPTED: K.RENTAL_PREEMPTED,
    RentalStatus.COMPLETED: K.RENTAL_COMPLETED,
}
# What the lifecycle calls rental_events_record for (the placement of a batch costs nothing).
RECORDED_STATUSES = frozenset(_KIND_BY_STATUS)
_RENTAL_VERB = {
    K.RENTAL_STARTED: "started",
    K.RENTAL_RESUMED: "resumed",
    K.RENTAL_FAILED: "failed",
    K.RENTAL_PREEMPTED: "was preempted",
    K.RENTAL_COMPLETED: "completed",
}


# --- settings -----------------------------------------------------------------------------------


def _kinds_off(kinds: Iterable[str], *, field: str) -> list[str]:
    """The stored form of a list of kinds switched on: the kinds switched off."""
    on = set(kinds)
    unknown = on - set(K.values)
    if unknown:
        raise ValidationFailed(f"unknown kind {sorted(unknown)[0]!r}", field=field)
    return [k for k in K.values if k not in on]


@dataclass(frozen=True, slots=True)
class SettingsChange:
    settings: NotificationSettings
    # The new signing secret, present only when this change made one: it is shown once.
    webhook_secret: str | None


@transaction.atomic
def notification_settings_update(
    *,
    team: Team,
    email_enabled: bool | None = None,
    email_kinds: Iterable[str] | None = None,
    webhook_url: str | None = None,
    webhook_kinds: Iterable[str] | None = None,
) -> SettingsChange:
    """Change what the team is told and where (its owners and billing members do: the view
    asks for that role); a webhook URL gets its signing secret the first time."""
    # Validate everything before writing anything.
    email_off = None if email_kinds is None else _kinds_off(email_kinds, field="email_kinds")
    webhook_off = (
        None if webhook_kinds is None else _kinds_off(webhook_kinds, field="webhook_kinds")
    )
    if webhook_url:
        webhooks.webhook_url_check(webhook_url)
    row, _ = NotificationSettings.objects.select_for_update().get_or_create(team=team)
    if email_enabled is not None:
        row.email_enabled = email_enabled
    if email_off is not None:
        row.email_off = email_off
    if webhook_off is not None:
        row.webhook_off = webhook_off
    secret = None
    if webhook_url is not None:
        row.webhook_url = webhook_url
        if webhook_url and not row.webhook_secret_salt:
            secret = _secret_draw(row)
    row.save()
    return SettingsChange(settings=row, webhook_secret=secret)


def _secret_draw(row: NotificationSettings) -> str:
    row.webhook_secret_salt = secrets.token_hex(32)
    row.webhook_secret_rotated_at = timezone.now()
    return webhooks.webhook_secret(row.webhook_secret_salt)


@transaction.atomic
def webhook_secret_rotate(*, team: Team) -> SettingsChange:
    """Draw a new signing secret; the old one stops at once. Shown once, in the answer."""
    row, _ = NotificationSettings.objects.select_for_update().get_or_create(team=team)
    secret = _secret_draw(row)
    row.save(update_fields=["webhook_secret_salt", "webhook_secret_rotated_at", "updated_at"])
    return SettingsChange(settings=row, webhook_secret=secret)


# --- recording (the outbox) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tell:
    """One thing a team is to be told (notification_record's arguments)."""

    team: Team
    kind: str
    source_key: str
    summary: str
    data: dict[str, Any]
    rental: Rental | None = None
    at: datetime | None = None


def notification_record(
    *,
    team: Team,
    kind: str,
    source_key: str,
    summary: str,
    data: dict[str, Any],
    rental: Rental | None = None,
    at: datetime | None = None,
) -> Notification | None:
    """Record that `team` is to be told `summary`, with a delivery per channel switched on for
    the kind (an email to each of audience.email_recipients), in the caller's transaction;
    queue them after it commits. Recording the same `source_key` again, or a kind every channel
    has switched off, records nothing."""
    tell = Tell(team=team, kind=kind, source_key=source_key, summary=summary, data=data,
                rental=rental, at=at)  # fmt: skip
    return notifications_record([tell])[0]


def notifications_record(tells: Sequence[Tell]) -> list[Notification | None]:
    """notification_record of each of `tells`, in a few statements for all of them (the
    teams' settings, their members, the notifications, which of them are new, the
    deliveries), however many there are: a launch tells of a hundred rentals at once."""
    if not tells:
        return []
    with transaction.atomic(savepoint=False):
        stored = NotificationSettings.objects.in_bulk(
            {tell.team.pk for tell in tells}, field_name="team_id"
        )
        settings_of = [stored.get(tell.team.pk) or NotificationSettings(team=tell.team)
                       for tell in tells]  # fmt: skip
        emailed = [
            i for i, (tell, row) in enumerate(zip(tells, settings_of, strict=True))
            if row.email_enabled and tell.kind not in row.email_off
        ]  # fmt: skip
        addresses = audience.email_recipients_many(
            [(tells[i].team, tells[i].kind, tells[i].rental) for i in emailed]
        )
        targets: list[list[tuple[str, str]]] = [[] for _ in tells]
        for i, found in zip(emailed, addresses, strict=True):
            targets[i] += [(Channel.EMAIL, address) for address in found]
        for i, (tell, row) in enumerate(zip(tells, settings_of, strict=True)):
            if row.webhook_url and tell.kind not in row.webhook_off:
                targets[i].append((Channel.WEBHOOK, ""))
        now = timezone.now()
        notifications: list[Notification | None] = [
            Notification(
                id=uuid.uuid4(), team=tell.team, kind=tell.kind, source_key=tell.source_key,
                rental=tell.rental, summary=tell.summary[:300], payload=tell.data,
                created_at=tell.at or now,
            ) if targets[i] else None
            for i, tell in enumerate(tells)
        ]  # fmt: skip
        new = [n for n in notifications if n is not None]
        if not new:
            return notifications
        # ON CONFLICT DO NOTHING: a fact recorded twice (a replayed call) stays one notification,
        # without failing the caller's transaction.
        Notification.objects.bulk_create(new, ignore_conflicts=True)
        kept = set(
            Notification.objects.filter(pk__in=[n.pk for n in new]).values_list("pk", flat=True)
        )
        notifications = [n if n is not None and n.pk in kept else None for n in notifications]
        deliveries = Delivery.objects.bulk_create(
            Delivery(notification=n, channel=channel, recipient=recipient,
                     next_attempt_at=n.created_at)
            for n, found in zip(notifications, targets, strict=True) if n is not None
            for channel, recipient in found
        )  # fmt: skip
        ids = [d.pk for d in deliveries]
        if ids:
            transaction.on_commit(lambda: _deliveries_queue(ids))
        return notifications


def rental_events_record(*, events: Sequence[tuple[Rental, RentalEvent]]) -> None:
    """The lifecycle's recorder, for one transition or a batch of them: a rental that
    started, resumed, failed, was preempted or completed is notified, in the transitions' own
    transaction."""
    told = [(rental, event, _KIND_BY_STATUS[event.to_status]) for rental, event in events
            if event.to_status in _KIND_BY_STATUS]  # fmt: skip
    started = [rental.pk for rental, _, kind in told if kind == K.RENTAL_STARTED]
    ran_before: set = set()
    if started:
        ran_before = set(
            RentalEvent.objects.filter(rental_id__in=started, to_status=RentalStatus.RUNNING)
            .exclude(pk__in=[event.pk for _, event, _ in told])
            .values_list("rental_id", flat=True)
        )
    tells = []
    for rental, event, kind in told:
        if kind == K.RENTAL_STARTED and rental.pk in ran_before:
            kind = K.RENTAL_RESUMED
        label = rental.name or f"rental {str(rental.pk)[:8]}"
        summary = f"{label} {_RENTAL_VERB[kind]}"
        if event.reason:
            summary += f": {event.reason}"
        tells.append(Tell(
            team=audience.team_of_rental(rental), kind=kind,
            source_key=f"rental-event:{event.pk}", summary=summary, rental=rental,
            at=event.created_at, data={"rental": _rental_data(rental, event)},
        ))  # fmt: skip
    notifications_record(tells)


def _rental_data(rental: Rental, event: RentalEvent) -> dict[str, Any]:
    return {
        "id": str(rental.pk),
        "name": rental.name,
        "status": event.to_status,
        "previous_status": event.from_status,
        "reason": event.reason,
        "gpus": rental.gpus_per_node * rental.node_count,
        "region": rental.region,
        "image": rental.image,
        "started_at": _iso(rental.started_at),
        "ended_at": _iso(rental.ended_at),
        "exit_code": rental.exit_code,
    }


def balance_low_notify(
    *, team: Team, notice_id: int, detail: str, available_micros: int, hourly_burn_micros: int
) -> Notification | None:
    """Billing found the team's balance low (or out): tell the team, in billing's
    transaction."""
    return notification_record(
        team=team,
        kind=K.BALANCE_LOW,
        source_key=f"balance-notice:{notice_id}",
        summary=f"Balance low: {detail}",
        data={
            "balance": {
                "available_micros": available_micros,
                "hourly_burn_micros": hourly_burn_micros,
                "detail": detail,
            }
        },
    )


def budget_reached_notify(
    *, team: Team, budget_key: str, summary: str, data: dict[str, Any]
) -> Notification | None:
    """A budget of the team was reached: tell the team, in the caller's transaction.
    `budget_key` names this crossing (e.g. "<budget id>:<period>"), so recording it twice
    tells once."""
    return notification_record(
        team=team,
        kind=K.BUDGET_REACHED,
        source_key=f"budget:{budget_key}"[:120],
        summary=summary,
        data={"budget": data},
    )


def gpu_failed_notify(
    *, owner: User, event_id: int, node_id: int, hostname: str, gpu_index: int, reason: str
) -> Notification | None:
    """A GPU of a provider's node failed and left placement: tell the provider (its owner's
    personal team), in the health change's transaction."""
    return notification_record(
        team=team_personal_ensure(user=owner),
        kind=K.GPU_FAILED,
        source_key=f"gpu-health:{event_id}",
        summary=f"GPU {gpu_index} of {hostname} failed ({reason}): it takes no rental until a "
        "check passes",
        data={"node": {"id": node_id, "hostname": hostname, "gpu": gpu_index, "reason": reason}},
    )


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _deliveries_queue(ids: Iterable[int]) -> None:
    """Best effort: with the broker down the sweep queues them later."""
    try:
        for pk in ids:
            current_app.send_task(DELIVER_TASK, args=(pk,))
    except Exception:
        log.warning("notification deliveries not queued (broker unreachable); the sweep will")


# --- delivery -----------------------------------------------------------------------------------


class _Retryable(Exception):
    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class _Permanent(Exception):
    pass


class _Skipped(Exception):
    pass


def notification_body(notification: Notification) -> dict[str, Any]:
    """What a webhook receives, the same on every attempt."""
    return {
        "id": str(notification.pk),
        "type": notification.kind,
        "created_at": notification.created_at.isoformat(),
        "summary": notification.summary,
        "data": notification.payload,
    }


def _send_webhook(delivery: Delivery, row: NotificationSettings | None, now: datetime) -> int:
    notification = delivery.notification
    if row is None or not row.webhook_url or notification.kind in row.webhook_off:
        raise _Skipped("the webhook was turned off")
    if not row.webhook_secret_salt:
        raise _Skipped("the webhook has no signing secret")
    try:
        result = webhooks.webhook_post(
            url=row.webhook_url,
            secret=webhooks.webhook_secret(row.webhook_secret_salt),
            event_id=str(notification.pk),
            timestamp=int(now.timestamp()),
            body=webhooks.body_encode(notification_body(notification)),
        )
    except webhooks.UnresolvableHost as exc:
        raise _Retryable(exc.message) from exc
    except webhooks.UnsafeUrl as exc:
        raise _Permanent(exc.message) from exc
    except requests.RequestException as exc:
        raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
    if not result.ok:
        raise _Retryable(f"the receiver answered {result.status_code}", result.status_code)
    return result.status_code


def _send_email(delivery: Delivery, row: NotificationSettings | None) -> None:
    notification = delivery.notification
    if row is not None and (not row.email_enabled or notification.kind in row.email_off):
        raise _Skipped("email was turned off")
    lines = [notification.summary, ""]
    rental = notification.payload.get("rental")
    if rental:
        lines += [f"Rental: {rental['id']}", f"Status: {rental['status']}"]
        if rental.get("reason"):
            lines.append(f"Reason: {rental['reason']}")
    lines += [
        f"When: {notification.created_at:%Y-%m-%d %H:%M:%S} UTC",
        "",
        "Choose what you are told on the Notifications page of gpumarket.",
    ]
    message = EmailMessage(
        subject=f"[gpumarket] {notification.summary}"[:200],
        body="\n".join(lines),
        to=[delivery.recipient],
        headers={"X-Gpumarket-Event-Id": str(notification.pk)},
    )
    try:
        message.send()
    except OSError as exc:  # smtplib.SMTPException is an OSError
        raise _Retryable(f"{type(exc).__name__}: {exc}") from exc


def _backoff(attempts: int) -> timedelta:
    base = settings.NOTIFICATIONS_RETRY_BASE_S
    return timedelta(
        seconds=min(base * 2 ** (attempts - 1), settings.NOTIFICATIONS_RETRY_MAX_DELAY_S)
    )


def delivery_attempt(*, delivery_id: int, now: datetime | None = None) -> str | None:
    """Make one attempt of a due delivery; returns its state after, or None when there was
    nothing to do (delivered already, not due yet, or being attempted by another worker).

    The row stays locked for the attempt, so two runs of the same task cannot both send; the
    receiver sees the same event id on every attempt, so one that succeeded but could not be
    recorded (the worker died) is recognised as a repeat."""
    with transaction.atomic():
        delivery = (
            Delivery.objects.select_for_update(of=("self",), skip_locked=True)
            .select_related("notification")
            .filter(pk=delivery_id, state=DeliveryState.PENDING)
            .first()
        )
        now = now or timezone.now()
        if delivery is None or delivery.next_attempt_at > now:
            return None
        row = NotificationSettings.objects.filter(team_id=delivery.notification.team_id).first()
        delivery.last_attempt_at = now
        try:
            delivery.attempts += 1
            if delivery.channel == Channel.WEBHOOK:
                delivery.last_status_code = _send_webhook(delivery, row, now)
            else:
                _send_email(delivery, row)
        except _Skipped as exc:
            delivery.attempts -= 1
            delivery.state = DeliveryState.SKIPPED
            delivery.last_error = str(exc)
        except _Permanent as exc:
            delivery.state = DeliveryState.FAILED
            delivery.last_error = str(exc)[:500]
        except _Retryable as exc:
            delivery.last_status_code = exc.status_code
            delivery.last_error = str(exc)[:500]
            if delivery.attempts >= settings.NOTIFICATIONS_MAX_ATTEMPTS:
                delivery.state = DeliveryState.FAILED
            else:
                delivery.next_attempt_at = now + _backoff(delivery.attempts)
        else:
            delivery.state = DeliveryState.DELIVERED
            delivery.delivered_at = now
            delivery.last_error = ""
        delivery.save()
    log.info(
        "notification delivery %s (%s) attempt %s: %s",
        delivery.pk,
        delivery.channel,
        delivery.attempts,
        delivery.state,
    )
    return delivery.state


def deliveries_due_queue(*, now: datetime | None = None, limit: int = 1000) -> int:
    """Queue the pending deliveries that are due (a retry whose time came, a message the broker
    lost); a delivery queued twice is attempted once (see delivery_attempt)."""
    now = now or timezone.now()
    ids = list(
        Delivery.objects.filter(state=DeliveryState.PENDING, next_attempt_at__lte=now)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )
    _deliveries_queue(ids)
    return len(ids)
