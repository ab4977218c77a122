"""Who a notification is for and who receives it: the one place that knows.

Settings, notifications and deliveries are keyed by an owner (today the customer who rents);
the recipients of its emails are resolved here only, so moving ownership to a team changes
these two functions and nothing else.
"""

from __future__ import annotations

from marketplace.models import Rental, User


def owner_of_rental(rental: Rental) -> User:
    return rental.customer


def email_recipients(owner: User) -> list[str]:
    """The addresses an owner's email notifications go to."""
    return [owner.email] if owner.email and owner.is_active else []
