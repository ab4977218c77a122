"""factory_boy factories for rows that have no service of their own to create them."""

import factory

from marketplace.models import Provider, Team, User
from marketplace.services import team_personal_ensure


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.invalid")
    password = factory.django.Password("pw-not-secret")
    # As marketplace.services.user_create does: every person owns a personal team.
    personal_team = factory.PostGeneration(
        lambda user, create, extracted, **kwargs: (
            team_personal_ensure(user=user) if create else None
        )
    )


class ProviderFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Provider

    name = factory.Sequence(lambda n: f"provider{n}")
    owner = factory.SubFactory(UserFactory)


def personal_team(user: User) -> Team:
    """The person's personal team (what they own unless they act for another team)."""
    return team_personal_ensure(user=user)
