"""Who a notification is for and who receives it: the one place that knows.

Settings, notifications and deliveries are the team's (the rental's team; the team whose
account the money notice is about). Its emails go to the people who act on them, not to every
member, so a busy team is not flooded:

- money (balance low, budget reached): the team's owners and billing members, who manage the
  money;
- a rental's events (started, resumed, preempted, failed, completed): the member who created
  the rental and the team's owners.

The team's settings switch each kind on or off for all of them (webhook and email alike).
"""

from __future__ import annotations

from accounts.models import Membership, Team, TeamRole
from marketplace.models import Rental, User

MONEY_KINDS = frozenset({"balance.low", "budget.reached"})


def team_of_rental(rental: Rental) -> Team:
    return rental.team


def email_recipients(team: Team, *, kind: str, rental: Rental | None = None) -> list[str]:
    """The addresses the team's email of this kind goes to (active people with an address,
    each once, in the order they joined)."""
    roles = (TeamRole.OWNER, TeamRole.BILLING) if kind in MONEY_KINDS else (TeamRole.OWNER,)
    people: list[User] = []
    if rental is not None and kind not in MONEY_KINDS:
        people.append(rental.customer)
    memberships = (
        Membership.objects.select_related("user")
        .filter(team=team, role__in=roles)
        .order_by("created_at", "pk")
    )
    people += [m.user for m in memberships]
    addresses: list[str] = []
    for person in people:
        if person.is_active and person.email and person.email not in addresses:
            addresses.append(person.email)
    return addresses
