"""`manage.py measure_quality MODEL [MODEL ...] [--unmeasured] [--wait SECONDS]`: ask a worker to
measure each model's perplexity, as the catalog's "Measure quality" button does."""

import time

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from controlplane.catalog.selectors import model_get_by_public_name
from controlplane.fleet.models import QualityMeasurement
from controlplane.fleet.services.quality import quality_measurement_request

# How often a command told to --wait tries again while no worker can take the measurement.
RETRY_EVERY_S = 5.0


def _measured_or_measuring(model) -> bool:
    """Whether the model has a perplexity, or its latest measurement is queued, running or done."""
    latest = model.quality_measurements.first()  # newest first (QualityMeasurement.Meta.ordering)
    return model.perplexity is not None or (latest is not None and latest.state != QualityMeasurement.State.FAILED)


class Command(BaseCommand):
    help = (
        "Ask a worker that has each model's checkpoint to measure its perplexity (python -m gpuworker.quality); "
        "the catalog page shows the progress and the figure."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("models", nargs="+", help="the models' public names")
        parser.add_argument(
            "--unmeasured",
            action="store_true",
            help=(
                "skip a model already measured or being measured (so a repeated run measures once); one "
                "whose last measurement failed, as when its worker stopped mid-way, is asked again"
            ),
        )
        parser.add_argument(
            "--wait",
            type=float,
            default=0.0,
            help="seconds to keep trying while no worker has the checkpoint yet (default: none)",
        )

    def handle(self, *args, models: list[str], unmeasured: bool, wait: float, **options) -> None:
        found = []
        for name in models:
            model = model_get_by_public_name(public_name=name)
            if model is None:
                raise CommandError(f"Unknown model {name!r}.")
            if unmeasured and _measured_or_measuring(model):
                self.stdout.write(f"{name}: already measured or being measured; skipped")
                continue
            found.append(model)
        deadline = time.monotonic() + wait
        for model in found:
            while True:
                try:
                    measurement = quality_measurement_request(model=model)
                    break
                except ValidationError as exc:
                    reason = " ".join(exc.messages)
                    if time.monotonic() + RETRY_EVERY_S > deadline:
                        raise CommandError(f"{model.public_name}: {reason}") from exc
                time.sleep(RETRY_EVERY_S)
            where = f"GPU {measurement.gpu_index}" if measurement.gpu_index is not None else "CPU"
            self.stdout.write(f"{model.public_name}: measuring on {measurement.worker.name} ({where})")
