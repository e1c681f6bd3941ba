"""`manage.py record_perplexity MODEL --report FILE`: store a worker's perplexity report on a catalog model."""

import json
import sys
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from controlplane.catalog.selectors import model_get_by_public_name, perplexity_increase
from controlplane.catalog.services import model_record_perplexity
from gpuworker.contract.heartbeat import ContractError
from gpuworker.contract.quality import parse_perplexity_report


class Command(BaseCommand):
    help = (
        "Record the JSON report of `python -m gpuworker.quality` (run on a worker) on a catalog model, "
        "and print its difference from its base model's perplexity."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("model", help="the model's public name")
        parser.add_argument("--report", default="-", help="the report's file (default: standard input)")

    def handle(self, *args, model: str, report: str, **options) -> None:
        found = model_get_by_public_name(public_name=model)
        if found is None:
            raise CommandError(f"Unknown model {model!r}.")
        try:
            text = sys.stdin.read() if report == "-" else Path(report).read_text()
            parsed = parse_perplexity_report(json.loads(text))
            found = model_record_perplexity(model=found, report=parsed)
        except (OSError, json.JSONDecodeError) as exc:
            raise CommandError(f"Cannot read the report: {exc}") from exc
        except ContractError as exc:
            raise CommandError(f"Bad report: {exc}") from exc
        except ValidationError as exc:
            raise CommandError("; ".join(m for ms in exc.message_dict.values() for m in ms)) from exc
        line = f"{found.public_name}: perplexity {found.perplexity:.3f} over {found.perplexity_tokens} tokens"
        increase = perplexity_increase(model=found)
        if increase is not None:
            line += f", {increase:+.2%} against {found.base_model.public_name}"
        self.stdout.write(line)
