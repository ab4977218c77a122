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

from collections import defaultdict
from collections.abc import Sequence

from accounts.models import Membership, Team, TeamRole
from marketplace.models import Rental, User

MONEY_KINDS = frozenset({"balance.low", "budget.reached"})


def team_of_rental(rental: Rental) -> Team:
    return rental.team


def email_recipients(team: Team, *, kind: str, rental: Rental | None = None) -> list[str]:
    """The addresses the team's email of this kind goes to (active people with an address,
    each once, in the order they joined)."""
    return email_recipients_many([(team, kind, rental)])[0]


def email_recipients_many(
    asked: Sequence[tuple[Team, str, Rental | None]],
) -> list[list[str]]:
    """email_recipients of each (team, kind, rental), the teams' members read in one
    statement (a launch tells a team of a hundred rentals at once)."""
    team_ids = {team.pk for team, _, _ in asked}
    members: dict[int, list[tuple[str, User]]] = defaultdict(list)
    memberships = (
        Membership.objects.select_related("user")
        .filter(team_id__in=team_ids, role__in=(TeamRole.OWNER, TeamRole.BILLING))
        .order_by("created_at", "pk")
    )
    for membership in memberships:
        members[membership.team_id].append((membership.role, membership.user))
    answers = []
    for team, kind, rental in asked:
        roles = (TeamRole.OWNER, TeamRole.BILLING) if kind in MONEY_KINDS else (TeamRole.OWNER,)
        people: list[User] = []
        if rental is not None and kind not in MONEY_KINDS:
            people.append(rental.customer)
        people += [user for role, user in members[team.pk] if role in roles]
        addresses: list[str] = []
        for person in people:
            if person.is_active and person.email and person.email not in addresses:
                addresses.append(person.email)
        answers.append(addresses)
    return answers
