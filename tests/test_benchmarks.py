"""The benchmark scripts' model-free parts run, and the report in docs/results.md renders from their JSON."""

import json
import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import accuracy  # noqa: E402  (the benchmark scripts, importable once their folder is on the path)
import fidelity  # noqa: E402
import gpu  # noqa: E402
import report  # noqa: E402
import serve  # noqa: E402


def test_toy_fidelity_runs_and_exact_sd_is_near_its_floor():
    toy = fidelity.toy_fidelity(samples=200, particles=(1, 4), draft_lens=(2,))
    assert {(r["method"], r["particles"], r["alpha"]) for r in toy["rows"]} == {
        ("sd", 1, 1.0), ("smc-sd", 1, 1.0), ("smc-sd", 4, 1.0), ("smc-sd", 1, 2.0), ("smc-sd", 4, 2.0)
    }
    assert all(0 <= r["tv"] <= 1 for r in toy["rows"])
    sd = next(r["tv"] for r in toy["rows"] if r["method"] == "sd")
    # exact sd samples the target: its TV is sampling noise, a few times the mean floor at most
    assert sd < 3 * toy["floor"]["1.0"]


def test_addition_items_and_grading():
    pairs = accuracy.items(50, seed=0)
    assert pairs == accuracy.items(50, seed=0) and all(0 <= a <= 9 and 0 <= b <= 9 for a, b in pairs)
    assert accuracy.is_correct(" 14\n2", 7, 7)
    assert not accuracy.is_correct(" 1", 7, 7) and not accuracy.is_correct(" none", 1, 1)


def test_sd_tokens_per_cycle_formula():
    assert gpu.expected_sd_tokens(0.0, 4) == 1.0
    assert gpu.expected_sd_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_a_failed_server_names_its_log_and_shows_both_streams():
    # vLLM logs an engine failure on stdout: the error must show stdout as well as stderr
    child = "import sys; print('engine core: the cause'); print('api: 500', file=sys.stderr); sys.exit(3)"
    server = serve.Process([sys.executable, "-c", child], dict(os.environ))
    server.process.wait(60)
    message = str(server.failed("row failed"))
    assert message.startswith(f"row failed (the server's log: {server.log})")
    assert "engine core: the cause" in message and "api: 500" in message and server.log.is_file()


def test_report_renders_from_committed_results():
    section = report.render()
    assert section.startswith(report.START) and section.endswith(report.END)
    for name in ("speed", "fidelity", "accuracy"):
        path = BENCHMARKS / "results" / f"{name}.json"
        if path.exists():
            json.loads(path.read_text())
            assert f"### {name.capitalize()}" in section
