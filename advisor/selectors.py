"""Every read of the advisor: the catalog's cards with their calibrated MFU priors."""

from __future__ import annotations

from advisor.engine.compute import Card
from advisor.models import AdvisorPrior
from marketplace.models import GpuModel
from marketplace.selectors import catalog_card


def advisor_cards() -> list[Card]:
    """The catalog as the advisor needs it, each card with its calibrated MFU prior if any."""
    priors = dict(AdvisorPrior.objects.values_list("card_id", "mfu"))
    return [catalog_card(m, priors.get(m.pk)) for m in GpuModel.objects.all()]


def advisor_card_get(slug: str) -> Card | None:
    """One catalog card as the advisor needs it (two indexed reads, not the whole catalog)."""
    model = GpuModel.objects.filter(slug=slug).first()
    if model is None:
        return None
    prior = AdvisorPrior.objects.filter(card=model).values_list("mfu", flat=True).first()
    return catalog_card(model, prior)
