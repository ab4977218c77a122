"""A team's saved rental runtimes: what runs (image, command, env, ports, datasets, harness config,
SSH, network), by name, so a rental starts from one instead of restating it."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from marketplace.models.rentals import RentalNetwork


class RentalTemplate(models.Model):
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="templates")
    name = models.SlugField(max_length=40)
    description = models.CharField(max_length=200, blank=True)
    image = models.CharField(max_length=255)
    command = models.JSONField(default=list, blank=True)
    env = models.JSONField(default=dict, blank=True)
    ports = models.JSONField(default=list, blank=True)
    datasets = models.JSONField(default=list, blank=True)
    harness_config = models.JSONField(null=True, blank=True)
    ssh = models.BooleanField(default=False)
    network = models.CharField(
        max_length=10, choices=RentalNetwork.choices, default=RentalNetwork.INTERNET
    )
    # Team secrets by name, as a rental takes them (accounts.services.secrets.secret_uses_parse).
    secrets = models.JSONField(default=list, blank=True)
    registry_secret = models.CharField(max_length=64, blank=True, default="", db_default="")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="template_name_unique_per_team")
        ]

    def __str__(self) -> str:
        return f"{self.team_id}/{self.name}"

    def runtime(self) -> dict:
        """The template as a rental request's `runtime`, `datasets`, `ssh`, `network` and
        secrets."""
        runtime: dict = {"image": self.image, "command": list(self.command), "env": dict(self.env)}
        runtime["ports"] = list(self.ports)
        if self.harness_config is not None:
            runtime["harness_config"] = self.harness_config
        body = {
            "runtime": runtime,
            "datasets": list(self.datasets),
            "ssh": self.ssh,
            "network": self.network,
        }
        body["secrets"] = {
            use["name"]: {k: use[k] for k in ("env", "file") if use[k]} for use in self.secrets
        }
        body["registry_secret"] = self.registry_secret
        return body
