"""`gpumarket notify ...` against the live server over real HTTP."""

import pytest

from accounts.services import api_token_create
from gpumarket_cli.main import main
from notifications.models import NotificationSettings
from tests.factories import personal_team

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli(live_server, user, capsys):
    _, token = api_token_create(user=user, team=personal_team(user), name="cli")

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["--server", live_server.url, "--token", token, "notify", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_show_set_rotate_and_list_deliveries(cli, user):
    # Given the defaults
    code, out, _ = cli("show")
    assert code == 0
    assert out.splitlines()[0].startswith("email: on  rental.started,rental.resumed,")
    assert out.splitlines()[1].startswith("webhook: none")
    # When a webhook is set and kinds are switched off per channel
    code, out, _ = cli(
        "set",
        "--webhook-url",
        "http://127.0.0.1:9/hook",
        "--email-off",
        "rental.started,rental.resumed",
        "--webhook-off",
        "balance.low",
        "--webhook-on",
        "rental.started",
    )
    # Then the secret is printed once, and the server stored exactly that
    assert code == 0, out
    secret_line = out.splitlines()[-1]
    assert secret_line.startswith("signing secret (shown once): whsec_")
    row = NotificationSettings.objects.get(team=personal_team(user))
    assert row.webhook_url == "http://127.0.0.1:9/hook"
    assert row.email_off == ["rental.started", "rental.resumed"]
    assert row.webhook_off == ["balance.low"]
    code, out, _ = cli("show")
    assert "whsec_" not in out and "webhook: http://127.0.0.1:9/hook" in out
    # A rotation prints a new secret; email can be turned off altogether
    code, out, _ = cli("rotate-secret")
    assert code == 0 and "whsec_" in out and out.split()[-1] != secret_line.split()[-1]
    code, out, _ = cli("set", "--no-email")
    assert code == 0 and out.startswith("email: off")
    code, out, _ = cli("deliveries")
    assert code == 0 and out.strip() == "no deliveries"


def test_bad_input_exits_non_zero_naming_the_field_and_changes_nothing(cli, user):
    code, _, err = cli("set", "--webhook-url", "https://10.1.2.3/hook")
    assert code == 1 and "400" in err and "webhook_url" in err
    code, _, err = cli("set", "--email-off", "rental.started", "--email-on", "rental.exploded")
    assert code == 1 and "email_kinds" in err
    assert not NotificationSettings.objects.filter(team=personal_team(user)).exists()
