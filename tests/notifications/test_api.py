"""The notifications API: settings, the secret shown once, validation, owner scoping."""

from __future__ import annotations

import pytest

from marketplace.models import RentalStatus
from notifications.models import Delivery, NotificationSettings
from tests.factories import UserFactory, personal_team
from tests.notifications.conftest import move

pytestmark = pytest.mark.django_db

SETTINGS = "/api/v1/notifications/settings/"
ROTATE = "/api/v1/notifications/settings/rotate-secret/"
DELIVERIES = "/api/v1/notifications/deliveries/"
ALL_KINDS = [
    "rental.started",
    "rental.resumed",
    "rental.preempted",
    "rental.failed",
    "rental.completed",
    "balance.low",
    "budget.reached",
    "node.gpu_failed",
]


def _stored():
    return list(NotificationSettings.objects.values())


def test_defaults_then_a_webhook_with_its_secret_shown_once(auth_api):
    # Given a customer who never changed anything: every email on, no webhook
    r = auth_api.get(SETTINGS)
    assert r.status_code == 200
    assert r.json() == {
        "email_enabled": True,
        "email_kinds": ALL_KINDS,
        "webhook_url": "",
        "webhook_kinds": ALL_KINDS,
        "webhook_secret_set": False,
        "webhook_secret_rotated_at": None,
        "kinds": ALL_KINDS,
    }
    # When they set a webhook and switch kinds off per channel
    r = auth_api.patch(
        SETTINGS,
        {
            "webhook_url": "https://93.184.215.14/hooks",
            "webhook_kinds": ["rental.failed", "balance.low"],
            "email_kinds": ["rental.completed"],
        },
    )
    # Then the answer carries the new signing secret, once
    assert r.status_code == 200, r.json()
    body = r.json()
    assert body["webhook_secret"].startswith("whsec_")
    assert body["webhook_kinds"] == ["rental.failed", "balance.low"]
    assert body["email_kinds"] == ["rental.completed"]
    assert body["webhook_secret_set"] is True
    again = auth_api.get(SETTINGS).json()
    assert "webhook_secret" not in again and again["webhook_url"] == "https://93.184.215.14/hooks"
    # A later change that keeps the URL makes no new secret; a rotation does
    later = auth_api.patch(SETTINGS, {"email_enabled": False}).json()
    assert later["webhook_secret"] is None and later["email_enabled"] is False
    rotated = auth_api.post(ROTATE).json()
    assert rotated["webhook_secret"].startswith("whsec_")
    assert rotated["webhook_secret"] != body["webhook_secret"]
    # The secret itself is not stored: only the salt it is derived from with SECRET_KEY
    row = NotificationSettings.objects.get()
    assert rotated["webhook_secret"] not in str(list(NotificationSettings.objects.values()))
    assert row.webhook_secret_salt and row.webhook_off == [
        "rental.started",
        "rental.resumed",
        "rental.preempted",
        "rental.completed",
        "budget.reached",
        "node.gpu_failed",
    ]


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://10.0.0.5/hook", "private"),
        ("https://169.254.169.254/latest/meta-data/", "private"),
        ("https://[fd00::1]/hook", "private"),
        ("https://[::ffff:192.168.1.1]/hook", "private"),
        ("https://100.64.0.1/hook", "private"),
        ("https://0.0.0.0/hook", "private"),
        ("ftp://93.184.215.14/hook", "https://"),
        ("https://user:pw@93.184.215.14/hook", "credentials"),
        ("https://93.184.215.14:99999/hook", "not a valid URL"),
        ("https://93.184.215.14/a b", "spaces"),
        ("https://93.184.215.14/a\x01", "control"),
        ("not a url", "spaces"),
        ("https:///nohost", "host"),
        ("https://no-such-host.invalid/hook", "does not resolve"),
        ("https://93.184.215.14/" + "a" * 500, "500 characters"),
    ],
)
def test_a_bad_webhook_url_is_a_400_naming_the_field_and_nothing_is_stored(auth_api, url, why):
    # Given settings already stored
    auth_api.patch(SETTINGS, {"email_kinds": ["rental.failed"]})
    before = _stored()
    # When a bad URL comes with a valid kind change
    r = auth_api.patch(SETTINGS, {"webhook_url": url, "email_kinds": ALL_KINDS})
    # Then a 400 names the field and says why; nothing changed
    assert r.status_code == 400, r.json()
    assert "webhook_url" in r.json()
    assert why in " ".join(r.json()["webhook_url"])
    assert _stored() == before


def test_production_refuses_http_and_loopback(auth_api, settings):
    # Given production rules (no loopback exception)
    settings.NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = False
    for url, why in [
        ("http://93.184.215.14/hook", "https only"),
        ("https://127.0.0.1/hook", "private"),
        ("https://localhost/hook", "private"),
        ("https://[::1]/hook", "private"),
    ]:
        r = auth_api.patch(SETTINGS, {"webhook_url": url})
        assert r.status_code == 400 and why in " ".join(r.json()["webhook_url"]), (url, r.json())
    assert _stored() == []


def test_development_allows_http_to_loopback_only(auth_api):
    # Given development rules: loopback over http is fine (a local receiver) ...
    r = auth_api.patch(SETTINGS, {"webhook_url": "http://127.0.0.1:8765/hook"})
    assert r.status_code == 200
    # ... but http elsewhere is not
    r = auth_api.patch(SETTINGS, {"webhook_url": "http://93.184.215.14/hook"})
    assert r.status_code == 400 and "https only" in " ".join(r.json()["webhook_url"])
    assert NotificationSettings.objects.get().webhook_url == "http://127.0.0.1:8765/hook"


def test_other_bad_input_is_a_400_naming_the_field(auth_api):
    cases = [
        ({"email_kinds": ["rental.exploded"]}, "email_kinds"),
        ({"webhook_kinds": "rental.started"}, "webhook_kinds"),
        ({"email_enabled": "maybe"}, "email_enabled"),
        ({"webhook_url": "https://93.184.215.14/\x00"}, "webhook_url"),
        ({"webhook_url": None}, "webhook_url"),
    ]
    for body, field in cases:
        r = auth_api.patch(SETTINGS, body)
        assert r.status_code == 400 and field in r.json(), (body, r.json())
    assert _stored() == []


def test_deliveries_are_scoped_to_their_owner(auth_api, user, rent, make_node):
    # Given a delivery of this customer and one of another
    make_node()
    mine = move(rent(), RentalStatus.SCHEDULED, RentalStatus.PROVISIONING, RentalStatus.RUNNING)
    other = UserFactory()
    move(
        rent(customer=other),
        RentalStatus.SCHEDULED,
        RentalStatus.PROVISIONING,
        RentalStatus.RUNNING,
    )
    own = Delivery.objects.get(notification__team=personal_team(user))
    foreign = Delivery.objects.get(notification__team=personal_team(other))
    # When the customer lists and reads deliveries
    listed = auth_api.get(DELIVERIES).json()
    # Then only their own are there; another account's id is a 404
    assert [d["id"] for d in listed["results"]] == [own.pk]
    row = listed["results"][0]
    assert (row["kind"], row["channel"], row["recipient"], row["state"]) == (
        "rental.started",
        "email",
        user.email,
        "pending",
    )
    assert row["rental_id"] == str(mine.pk)
    assert auth_api.get(f"{DELIVERIES}{own.pk}/").status_code == 200
    r = auth_api.get(f"{DELIVERIES}{foreign.pk}/")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    assert auth_api.get(f"{DELIVERIES}?state=delivered").json()["results"] == []
    assert auth_api.get(f"{DELIVERIES}?state=lost").status_code == 400


def test_anonymous_callers_are_refused(api):
    assert api.get(SETTINGS).status_code in (401, 403)
    assert api.patch(SETTINGS, {"email_enabled": False}).status_code in (401, 403)
    assert api.get(DELIVERIES).status_code in (401, 403)
    assert _stored() == []


def test_the_page_shows_the_settings_and_needs_a_login(client, user):
    r = client.get("/notifications/")
    assert r.status_code == 302 and "/accounts/login/" in r["Location"]
    client.force_login(user)
    r = client.get("/notifications/")
    assert r.status_code == 200
    page = r.content.decode()
    assert 'value="rental.started"' in page and "Nothing sent yet." in page
    assert "/api/v1/notifications/settings/" in page
