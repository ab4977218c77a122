"""What the advisor learns from real runs: a per-card MFU prior and the estimate-vs-measured log."""

from django.db import models
from django.db.models import Q


class AdvisorPrior(models.Model):
    """The share of a card's dense peak that runs on it reach, moved toward each measured run."""

    card = models.OneToOneField(
        "marketplace.GpuModel", on_delete=models.CASCADE, related_name="advisor_prior"
    )
    mfu = models.FloatField()
    runs = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        # Created by the marketplace app before the advisor was an app of its own.
        db_table = "marketplace_advisorprior"
        constraints = [
            models.CheckConstraint(condition=Q(mfu__gt=0) & Q(mfu__lte=1), name="prior_mfu_range")
        ]

    def __str__(self) -> str:
        return f"{self.card_id}: {self.mfu:.3f} after {self.runs} runs"


class AdvisorCheck(models.Model):
    """One harness run's measured step time, throughput and peak memory beside the estimate."""

    rental = models.OneToOneField(
        "marketplace.Rental", on_delete=models.CASCADE, related_name="advisor_check"
    )
    card = models.SlugField(max_length=40)
    gpus = models.PositiveIntegerField()
    estimated_step_s = models.FloatField()
    measured_step_s = models.FloatField()
    estimated_tokens_per_s = models.FloatField()
    measured_tokens_per_s = models.FloatField()
    estimated_peak_gb = models.FloatField()
    measured_peak_gb = models.FloatField(null=True, blank=True)
    prior_before = models.FloatField()
    prior_after = models.FloatField()
    simulated = models.BooleanField(
        default=False,
        help_text="ran on a simulated host (on its CPU): shown, but moves no prior and is left "
        "out of the advisor's accuracy",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "marketplace_advisorcheck"
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=Q(estimated_step_s__gt=0) & Q(measured_step_s__gt=0),
                name="check_steps_positive",
            )
        ]

    def __str__(self) -> str:
        return f"{self.rental_id}: {self.ratio:.2f}x"

    @property
    def ratio(self) -> float:
        """Measured over estimated step time: above 1, the run was slower than advised."""
        return self.measured_step_s / self.estimated_step_s
