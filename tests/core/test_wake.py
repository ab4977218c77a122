"""Wake tickets: signed for one node, refused when forged, altered or expired."""

from __future__ import annotations

import time

import pytest

from core.wake import wake_ticket_issue, wake_ticket_verify

NOW = 1_800_000_000.0


def test_a_ticket_names_its_node_and_when_it_was_issued():
    ticket = wake_ticket_issue(node_id=42, issued_at=NOW + 0.25, ttl_s=600)
    verified = wake_ticket_verify(ticket, now=NOW + 599)
    assert verified is not None
    assert (verified.node_id, verified.issued_at, verified.expires_at) == (
        42,
        NOW + 0.25,
        NOW + 600,
    )


def _altered(ticket: str, index: int, value: str) -> str:
    parts = ticket.split(".")
    parts[index] = value
    return ".".join(parts)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: _altered(t, 0, "43"), id="another node"),
        pytest.param(lambda t: _altered(t, 2, str(int(NOW) + 10**6)), id="a later expiry"),
        pytest.param(lambda t: _altered(t, 1, "0"), id="an earlier issue time"),
        pytest.param(lambda t: _altered(t, 3, "A" * 43), id="a made-up signature"),
        pytest.param(lambda t: t[:-1], id="a cut signature"),
        pytest.param(lambda t: "", id="empty"),
        pytest.param(lambda t: "42.1.2", id="no signature"),
        pytest.param(lambda t: "x" * 5000, id="huge"),
        pytest.param(lambda t: "-1.1.9999999999.abc", id="negative node"),
    ],
)
def test_an_altered_or_made_up_ticket_is_refused(make):
    ticket = wake_ticket_issue(node_id=42, issued_at=NOW, ttl_s=600)
    assert wake_ticket_verify(make(ticket), now=NOW) is None


def test_an_expired_ticket_is_refused():
    ticket = wake_ticket_issue(node_id=42, issued_at=NOW, ttl_s=600)
    assert wake_ticket_verify(ticket, now=NOW + 601) is None


def test_a_ticket_signed_with_another_key_is_refused(settings):
    ticket = wake_ticket_issue(node_id=42, issued_at=time.time(), ttl_s=600)
    settings.SECRET_KEY = "another-deployment-" + "k" * 40
    assert wake_ticket_verify(ticket, now=time.time()) is None
