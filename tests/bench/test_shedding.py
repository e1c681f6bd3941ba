"""The shedding benchmark (bench/shedding.py): its figures from client answers, its targets, its
arguments, and the whole script on the CPU with a tiny model (the embedded control plane: no
PostgreSQL, no Redis)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.shedding import Answer, parse_args, summarise, targets

REPO = Path(__file__).resolve().parents[2]


def _served(sent: float, first: float, answered: float, tokens: int, expected: int | None = None) -> Answer:
    return Answer(expected or tokens, sent=sent, status=200, first_token=first, answered=answered, output_tokens=tokens)


def _refused(sent: float, answered: float, status: int = 429, code: str | None = "overloaded") -> Answer:
    return Answer(8, sent=sent, status=status, code=code, answered=answered, error=f"HTTP {status}")


def test_admitted_ttft_goodput_and_shed_answer_times_come_from_the_answers():
    answers = [
        _served(0.0, 0.5, 2.0, 10),
        _served(1.0, 2.0, 4.0, 20),
        _served(1.0, 1.5, 3.0, 2, expected=8),  # cut short: admitted, not finished
        _refused(2.0, 2.01),
        _refused(3.0, 3.04),
        _refused(3.0, 3.001, code="rate_limit_exceeded"),  # refused, but not shed
    ]
    run = summarise(answers)
    assert (run["requests"], run["admitted"], run["finished"], run["shed"], run["failed"]) == (6, 3, 2, 2, 2)
    assert run["seconds"] == pytest.approx(4.0)  # first send to last answer
    assert run["goodput_output_tok_s"] == pytest.approx(30 / 4.0)  # finished admitted requests only
    assert run["requests_per_s"] == pytest.approx(2 / 4.0)
    assert run["ttft_p50_s"] == pytest.approx(0.5)  # of 0.5, 1.0 and 0.5: every admitted one
    assert run["shed_answer_max_s"] == pytest.approx(0.04)
    assert run["shed_answer_p50_s"] == pytest.approx(0.025)
    assert run["first_error"] == "2 of 8 tokens"


def test_targets_pass_fail_or_have_nothing_to_judge():
    run = summarise([_served(0.0, 1.0, 2.0, 100), _refused(0.5, 0.53)])
    rules = dict(slo_s=2.0, goodput_share=0.95, shed_answer_s=0.05)
    assert targets(run, 52.0, **rules) == {
        "ttft_p99_within_objective": True,
        "goodput_share_of_saturation": True,  # 50 tok/s >= 0.95 x 52
        "every_shed_answer_in_time": True,
    }
    assert targets(run, 60.0, **rules | {"slo_s": 0.5, "shed_answer_s": 0.01}) == {
        "ttft_p99_within_objective": False,
        "goodput_share_of_saturation": False,
        "every_shed_answer_in_time": False,
    }
    # Nothing shed: no answer time to judge.
    assert targets(summarise([_served(0.0, 1.0, 2.0, 100)]), 50.0, **rules)["every_shed_answer_in_time"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-len", "10"], "--prompt-len"),
        (["--output-len", "9,3"], "--output-len"),
        (["--multiple", "0"], "--multiple"),
        (["--ttft-slo-ms", "600000"], "--ttft-slo-ms"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_smoke_keeps_what_is_given_on_the_command_line():
    args = parse_args(["--smoke", "--duration", "2"])
    assert (args.device, args.duration, args.ttft_slo_ms) == ("cpu", 2.0, 100)


@pytest.mark.slow
def test_the_script_sheds_beside_arrival_order_on_the_cpu(tmp_path):
    plot = tmp_path / "shedding.png"
    out = subprocess.run(
        [sys.executable, "bench/shedding.py", "--smoke", "--plot", str(plot)],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "shedding.json").read_text())
    assert result["saturation"]["failed"] == 0 and result["saturation"]["goodput_output_tok_s"] > 0
    on, off = result["runs"]["shedding on"], result["runs"]["shedding off"]
    assert on["requests"] == off["requests"] > 0  # the same arrivals, twice
    # Every request is admitted or shed; with no objective nothing is shed.
    assert on["admitted"] + on["shed"] == on["requests"], on.get("first_error")
    assert (off["shed"], off["admitted"]) == (0, off["requests"]) and off["finished"] > 0, off.get("first_error")
    assert set(on["targets"]) == {
        "ttft_p99_within_objective",
        "goodput_share_of_saturation",
        "every_shed_answer_in_time",
    }
    assert plot.stat().st_size > 0
    assert "| shedding on |" in out.stdout and "| shedding off |" in out.stdout
