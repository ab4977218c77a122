from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from marketplace.services.rentals import RentalRequest, RuntimeSpec, rental_create


@pytest.fixture
def rent(user):
    """Create a rental through the real service."""

    def make(gpus: int = 1, *, customer=None, **kwargs):
        for name in ("max_price_per_gpu_hour", "bid_per_gpu_hour", "min_tensor_tflops"):
            if isinstance(kwargs.get(name), str):
                kwargs[name] = Decimal(kwargs[name])
        kwargs.setdefault("duration_s", 3600)
        return rental_create(
            customer=customer or user,
            request=RentalRequest(
                gpus_per_node=gpus, runtime=RuntimeSpec(image="gpumarket/harness:dev"), **kwargs
            ),
        )

    return make


def soon(**kwargs):
    return timezone.now() + timedelta(**kwargs)
