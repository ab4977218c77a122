"""factory_boy factories for rows that have no service of their own to create them."""

import factory

from marketplace.models import Provider, User
from marketplace.services import user_email_verified_set


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = User
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.invalid")
    password = factory.django.Password("pw-not-secret")

    @factory.post_generation
    def email_verified(obj, create, extracted, **kwargs):
        """A person who signed up and followed the link (email_verified=False: one who has not)."""
        if create and extracted is not False:
            user_email_verified_set(user=obj)


class ProviderFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Provider

    name = factory.Sequence(lambda n: f"provider{n}")
    owner = factory.SubFactory(UserFactory)
