"""Wake-ups: telling a node's agent at once that its desired state changed.

Agents heartbeat on their own schedule; a wake-up only makes the next heartbeat come now, so
nothing depends on it arriving. Two halves, both here so that no app needs another:

- publishing: `nodes_wake(node_ids=...)`, called in the transaction that changes what a node
  should run (a placement's allocations, a rental entering or leaving CONTAINER_WANTED),
  publishes ONE message on one Redis pub/sub channel after that transaction commits. The
  wake servers (provisioning.wakeserver) subscribe to it and answer their waiting long-polls.
  Best effort: Redis down, no wake server, the message is dropped and logged at debug level.
- tickets: the heartbeat answer hands the agent a short-lived ticket signed with the
  SECRET_KEY (HMAC-SHA256, its own salt) naming the node, the time it was issued and when it
  expires. The wake server checks it without the database; a ticket names one node, so a
  provider's agent hears only of its own node, and only that it changed, never what.

A message says when its wake-up is due (`at`, epoch seconds; now, or a placement's booked start
a little later) and when it was published (`t`). A wake server keeps each node's last wake-up,
so a long-poll that arrives after it (its ticket issued before the wake-up) is answered at once:
the heartbeat that issued the ticket took its time before it read the desired state, and a
change committed after that read is published after it too.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils.crypto import salted_hmac

from agentprotocol import WakeChannel
from core.redis_clients import redis_clients

log = logging.getLogger(__name__)

_SALT = "gpumarket.wake.ticket"
DEFAULT_CHANNEL = "gpumarket:wake"
DEFAULT_TICKET_TTL_S = 600


def wake_settings() -> dict:
    return {
        "url": settings.GPUMARKET.get("WAKE_URL", ""),
        "channel": settings.GPUMARKET.get("WAKE_CHANNEL") or DEFAULT_CHANNEL,
        "ticket_ttl_s": int(settings.GPUMARKET.get("WAKE_TICKET_TTL_S") or DEFAULT_TICKET_TTL_S),
    }


def wake_enabled() -> bool:
    """A wake server is deployed (WAKE_URL set): tickets are handed out and wakes published."""
    return bool(settings.GPUMARKET.get("WAKE_URL"))


# -- tickets -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WakeTicket:
    node_id: int
    issued_at: float  # epoch seconds, server clock, taken before the heartbeat read anything
    expires_at: int


def _signature(body: str) -> str:
    digest = salted_hmac(_SALT, body, algorithm="sha256").digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def wake_ticket_issue(*, node_id: int, issued_at: float, ttl_s: int | None = None) -> str:
    """`<node>.<issued ms>.<expires s>.<signature>`: short, URL- and header-safe."""
    ttl = ttl_s if ttl_s is not None else wake_settings()["ticket_ttl_s"]
    body = f"{int(node_id)}.{int(issued_at * 1000)}.{int(issued_at) + ttl}"
    return f"{body}.{_signature(body)}"


def wake_ticket_verify(ticket: str, *, now: float) -> WakeTicket | None:
    """The ticket's node if it is ours and not expired, else None (whatever is wrong with it:
    the caller answers 401 and says no more)."""
    if not isinstance(ticket, str) or len(ticket) > 200:
        return None
    parts = ticket.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        return None
    body = ".".join(parts[:3])
    if not hmac.compare_digest(parts[3], _signature(body)):
        return None
    node_id, issued_ms, expires_at = (int(p) for p in parts[:3])
    if expires_at < now:
        return None
    return WakeTicket(node_id=node_id, issued_at=issued_ms / 1000, expires_at=expires_at)


def wake_channel(*, node_id: int, issued_at: float) -> WakeChannel | None:
    """What a heartbeat answer tells the agent: where to wait, with a fresh ticket."""
    config = wake_settings()
    if not config["url"]:
        return None
    ticket = wake_ticket_issue(node_id=node_id, issued_at=issued_at, ttl_s=config["ticket_ttl_s"])
    return WakeChannel(url=config["url"], ticket=ticket)


# -- publishing ----------------------------------------------------------------------------------


def wake_message(*, node_ids: Iterable[int], at: float, published_at: float) -> str:
    return json.dumps({"t": round(published_at, 3), "at": round(at, 3), "n": sorted(node_ids)})


def nodes_wake(*, node_ids: Iterable[int], at: datetime | None = None) -> None:
    """Wake these nodes' agents once the current transaction commits (at once outside one);
    `at`: not before then (a placement booked to start a little later)."""
    if not wake_enabled():
        return
    ids = {int(i) for i in node_ids if i is not None}
    if not ids:
        return
    due = at.timestamp() if at is not None else 0.0
    transaction.on_commit(lambda: _publish(ids, due))


def _publish(ids: set[int], due: float) -> None:
    # The time is taken after commit: a heartbeat whose ticket was issued later read the change.
    now = time.time()
    message = wake_message(node_ids=ids, at=max(now, due), published_at=now)
    clients = redis_clients()
    client = clients.hot()
    if client is None:
        return
    try:
        client.publish(wake_settings()["channel"], message)
    except Exception as exc:  # a lost wake-up costs one heartbeat interval, never the change
        clients.hot_failed(exc)


def wake_listeners() -> int:
    """How many wake servers listen on the channel now (PUBSUB NUMSUB); 0 when none does or
    Redis does not answer: nothing would wake an idle agent."""
    clients = redis_clients()
    client = clients.hot()
    if client is None:
        return 0
    channel = wake_settings()["channel"]
    try:
        counts = dict(client.pubsub_numsub(channel))
    except Exception as exc:  # the caller then keeps agents at the base interval
        clients.hot_failed(exc)
        return 0
    return int(counts.get(channel.encode(), counts.get(channel, 0)))
