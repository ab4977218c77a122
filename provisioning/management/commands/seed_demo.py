from django.core.management.base import BaseCommand

from provisioning.demo import load_demo


class Command(BaseCommand):
    help = "Load the demo inventory (idempotent): ops user, demo customer, simulated nodes."

    def handle(self, *args, **options):
        result = load_demo()
        self.stdout.write(f"demo inventory: {result}")
