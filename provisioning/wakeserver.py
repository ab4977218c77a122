"""The wake server: agents long-poll it to hear at once that their node's desired state changed.

One asyncio process (aiohttp) holds every waiting agent's GET open, up to `timeout` seconds
(WAKE_POLL_MAX_S at most), and answers {"woken": true} the moment its node is woken, else
{"woken": false}. It subscribes ONE Redis pub/sub channel (core.wake publishes there after each
commit that changes what a node runs) and dispatches in-process: no database, no Redis call per
request. Each request is authenticated by its wake ticket alone (an HMAC the web tier signs
with the SECRET_KEY, naming one node): a ticket for node A waits only for node A's wake-ups,
and a forged, foreign-signed or expired one is answered 401 before anything else.

Scale-out: every wake process subscribes the same channel and sees every message (a few node
ids each), so any number of them can run behind one load balancer, each holding its share of
the connections; a message costs each process one dict look-up per node id it names.

A wake-up names when it is due (`at`); one due later (a booking that starts in a few seconds)
is kept as a timer, up to MAX_DELAY_S ahead. Each node's last wake-up is kept for the ticket
lifetime, so a long-poll that comes in after it with an older ticket is answered at once: the
agent heartbeats, and its next poll carries the newer ticket of that heartbeat's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from agentprotocol import WAKE_POLL_MAX_S
from core.wake import WakeTicket, wake_ticket_verify

log = logging.getLogger(__name__)

WAKE_PATH = "/wake/v1/wait"
HEALTH_PATH = "/wake/v1/healthz"
DEFAULT_POLL_S = 25.0
# One agent needs one waiting poll; a few allow for a restart whose old poll is still open.
MAX_WAITERS_PER_NODE = 4
MAX_DELAY_S = 3600.0
MAX_TIMERS = 100_000
MAX_IDS_PER_MESSAGE = 100_000
PRUNE_EVERY_S = 60.0
RESUBSCRIBE_MAX_S = 30.0


class WakeHub:
    """The waiting polls by node, and each node's last wake-up."""

    def __init__(self, *, keep_s: float, clock=time.time) -> None:
        self.keep_s = keep_s
        self._clock = clock
        self._waiters: dict[int, set[asyncio.Future[bool]]] = {}
        self._woken: dict[int, float] = {}
        self._timers = 0
        self.subscribed = False
        self.counts = {"polls": 0, "woken": 0, "timeouts": 0, "refused": 0, "messages": 0}

    @property
    def waiting(self) -> int:
        return sum(len(futures) for futures in self._waiters.values())

    def dispatch(self, raw: bytes | str) -> None:
        """One channel message: wake its nodes now, or when it is due."""
        try:
            message = json.loads(raw)
            ids = message["n"]
            # Both times are the publisher's clock, the clock that issued the tickets.
            published = float(message.get("t") or 0.0)
            due = float(message.get("at") or 0.0)
            if not isinstance(ids, list) or len(ids) > MAX_IDS_PER_MESSAGE:
                raise ValueError("n must be a list of node ids")
            node_ids = [int(i) for i in ids]
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("wake message ignored: %s", exc)
            return
        self.counts["messages"] += 1
        delay = due - max(published, self._clock())
        if delay <= 0.001:
            self.wake(node_ids, at=max(published, due) or self._clock())
        elif delay <= MAX_DELAY_S and self._timers < MAX_TIMERS:
            self._timers += 1
            asyncio.get_running_loop().call_later(delay, self._wake_later, node_ids, due)
        # Further ahead (or too many timers): the agents' heartbeats find it in time.

    def _wake_later(self, node_ids: list[int], due: float) -> None:
        self._timers -= 1
        self.wake(node_ids, at=due)

    def wake(self, node_ids: Iterable[int], *, at: float) -> None:
        for node_id in node_ids:
            self._woken[node_id] = at
            for future in self._waiters.pop(node_id, ()):
                if not future.done():
                    future.set_result(True)
                    self.counts["woken"] += 1

    def full(self, node_id: int) -> bool:
        return len(self._waiters.get(node_id, ())) >= MAX_WAITERS_PER_NODE

    async def wait(self, ticket: WakeTicket, timeout_s: float) -> bool:
        """True when the node was woken after the ticket was issued, now or within timeout_s."""
        self.counts["polls"] += 1
        if self._woken.get(ticket.node_id, 0.0) > ticket.issued_at:
            self.counts["woken"] += 1
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._waiters.setdefault(ticket.node_id, set()).add(future)
        timer = loop.call_later(timeout_s, _settle, future, False)
        try:
            woken = await future
        finally:
            timer.cancel()
            waiters = self._waiters.get(ticket.node_id)
            if waiters is not None:
                waiters.discard(future)
                if not waiters:
                    del self._waiters[ticket.node_id]
        if not woken:
            self.counts["timeouts"] += 1
        return woken

    def release_all(self) -> None:
        """Answer every waiting poll "not woken" (the server stops: agents poll elsewhere)."""
        waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            for future in futures:
                _settle(future, False)

    def prune(self) -> None:
        """Forget wake-ups older than any ticket still valid."""
        horizon = self._clock() - self.keep_s
        for node_id in [n for n, at in self._woken.items() if at < horizon]:
            del self._woken[node_id]


def _settle(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _refuse(hub: WakeHub, status: int, detail: str) -> web.Response:
    hub.counts["refused"] += 1
    return web.json_response({"detail": detail}, status=status)


async def _wait_view(request: web.Request) -> web.Response:
    hub: WakeHub = request.app["hub"]
    scheme, _, ticket_text = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or not ticket_text:
        return _refuse(hub, 401, "ticket: missing (Authorization: Bearer <wake ticket>)")
    ticket = wake_ticket_verify(ticket_text.strip(), now=time.time())
    if ticket is None:
        return _refuse(hub, 401, "ticket: invalid or expired")
    try:
        timeout_s = float(request.query.get("timeout", DEFAULT_POLL_S))
    except ValueError:
        return _refuse(hub, 400, "timeout: not a number")
    if not 0 <= timeout_s <= WAKE_POLL_MAX_S:
        return _refuse(hub, 400, f"timeout: between 0 and {WAKE_POLL_MAX_S} seconds")
    if hub.full(ticket.node_id):
        return _refuse(hub, 429, "too many polls for this node")
    woken = await hub.wait(ticket, timeout_s)
    return web.json_response({"woken": woken})


async def _health_view(request: web.Request) -> web.Response:
    hub: WakeHub = request.app["hub"]
    body: dict[str, Any] = {"subscribed": hub.subscribed, "waiting": hub.waiting, **hub.counts}
    return web.json_response(body, status=200 if hub.subscribed else 503)


async def subscribe(hub: WakeHub, *, redis_url: str, channel: str) -> None:
    """Feed the hub from the channel for ever, subscribing again after any failure (while it
    is down the polls time out and the agents heartbeat as they would without a wake server)."""
    import redis.asyncio as aioredis

    failures = 0
    while True:
        client = aioredis.Redis.from_url(redis_url, socket_connect_timeout=5)
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                hub.subscribed = True
                failures = 0
                log.info("wake server subscribed to %s", channel)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        hub.dispatch(message["data"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Redis gone or restarting: try again with backoff
            log.warning("wake channel lost: %s", exc)
        finally:
            hub.subscribed = False
            with contextlib.suppress(Exception):
                await client.aclose()
        failures += 1
        await asyncio.sleep(min(RESUBSCRIBE_MAX_S, 0.5 * 2 ** min(failures, 6)))


async def _prune_forever(hub: WakeHub) -> None:
    while True:
        await asyncio.sleep(PRUNE_EVERY_S)
        hub.prune()


def wake_app(*, redis_url: str, channel: str, keep_s: float) -> web.Application:
    """The aiohttp application, with its subscriber and pruner as background tasks."""
    app = web.Application()
    hub = WakeHub(keep_s=keep_s)
    app["hub"] = hub
    app.router.add_get(WAKE_PATH, _wait_view)
    app.router.add_get(HEALTH_PATH, _health_view)

    async def background(app: web.Application):
        tasks = [
            asyncio.create_task(subscribe(hub, redis_url=redis_url, channel=channel)),
            asyncio.create_task(_prune_forever(hub)),
        ]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def release(app: web.Application) -> None:
        hub.release_all()

    app.cleanup_ctx.append(background)
    app.on_shutdown.append(release)
    return app
