"""factory_boy factories for rows that have no service of their own to create them."""

import factory

from marketplace.models import Provider, User


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.invalid")
    password = factory.django.Password("pw-not-secret")


class ProviderFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Provider

    name = factory.Sequence(lambda n: f"provider{n}")
    owner = factory.SubFactory(UserFactory)
