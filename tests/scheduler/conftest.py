from datetime import timedelta

from django.utils import timezone


def soon(**kwargs):
    return timezone.now() + timedelta(**kwargs)
