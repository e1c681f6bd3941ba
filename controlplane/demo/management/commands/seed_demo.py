"""`manage.py seed_demo`: create (or reuse) the demo objects and write `.env.demo`."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.demo.seed import seed_demo


class Command(BaseCommand):
    help = (
        "Seed the demo admin login, tenant, credits, API key, and the demo model (weights and deployment); idempotent."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--env-file",
            type=Path,
            default=settings.BASE_DIR / ".env.demo",
            help="Where to keep the demo's API key and password (default: .env.demo).",
        )

    def handle(self, *args, env_file: Path, **options) -> None:
        seed = seed_demo(env_path=env_file)
        if seed.created:
            self.stdout.write("Seeded: " + ", ".join(seed.created) + ".")
        else:
            self.stdout.write("Demo data already present; nothing to create.")
        self.stdout.write(f"Demo login and API key are in {env_file}.")
