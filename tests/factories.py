"""factory_boy factories for rows that have no service of their own to create them."""

import factory
from allauth.mfa.totp.internal.auth import TOTP

from accounts.models import Team
from accounts.services import team_personal_ensure, user_email_verified_set
from marketplace.models import Provider, User

STAFF_TOTP_SECRET = "JBSWY3DPEHPK3PXP"


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.invalid")
    password = factory.django.Password("pw-not-secret")
    # As accounts.services.user_create does: every person owns a personal team.
    personal_team = factory.PostGeneration(
        lambda user, create, extracted, **kwargs: (
            team_personal_ensure(user=user) if create else None
        )
    )

    @factory.post_generation
    def email_verified(obj, create, extracted, **kwargs):
        """A person who signed up and followed the link (email_verified=False: one who has not)."""
        if create and extracted is not False:
            user_email_verified_set(user=obj)

    @factory.post_generation
    def totp(obj, create, extracted, **kwargs):
        """Staff have an authenticator app, as the admin demands (totp=False: staff who have
        not set one up yet); totp="BASE32SECRET" gives anyone that one."""
        if not create or extracted is False or not (extracted or obj.is_staff):
            return
        TOTP.activate(obj, extracted if isinstance(extracted, str) else STAFF_TOTP_SECRET)


class ProviderFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Provider

    name = factory.Sequence(lambda n: f"provider{n}")
    owner = factory.SubFactory(UserFactory)


def personal_team(user: User) -> Team:
    """The person's personal team (what they own unless they act for another team)."""
    return team_personal_ensure(user=user)
