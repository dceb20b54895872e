"""How long smc-sd takes to start: `smc-sd --help`, the imports a run pays, and the README's first
command end to end.

Every timing is a fresh process (nothing cached in memory; the first command's one-off fp32
conversion of the default model is done by a warm-up run first), the median of --repeats runs,
each child with OMP_NUM_THREADS=--threads:

- help: wall seconds of `smc-sd --help` (the installed console script).
- imports: wall and CPU seconds of `import X` inside a fresh interpreter (interpreter start
  excluded), for the pieces a run loads, each with everything it imports itself; genlm-control
  is listed to show what a run no longer pays (a run loads it only for a genlm-control potential).
- first_command: wall seconds of the README's set-up command (read from README.md), its CPU
  seconds (user + sys: on a shared machine wall time grows with the load, CPU time much less),
  and the generation seconds its summary line reports; `phases` splits one more run of it with
  --json into the models' load, the generation and the rest (imports, checks, compiling).

    python benchmarks/startup.py [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time

from _common import emit, environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the modules a run of the first command imports, and genlm-control, which it no longer does
IMPORTS = ["smc_sd", "smc_sd.cli", "torch", "smc_sd.program", "transformers", "smc_sd.backends.hf", "smc_sd.constraints.languages", "genlm.control"]
# the summary line's "[34 tokens in 2.86 s, ..."
SUMMARY = re.compile(r"\[(\d+) tokens in ([0-9.]+) s")


def readme_first_command(readme: pathlib.Path = ROOT / "README.md") -> list[str]:
    """The `smc-sd generate ...` command of the README's set-up line, as argv."""
    for line in readme.read_text().splitlines():
        if line.startswith("pip install") and "smc-sd generate" in line:
            command = next(part for part in line.split(" && ") if part.startswith("smc-sd generate"))
            return shlex.split(command)
    raise ValueError(f"{readme} has no set-up line with an smc-sd generate command")


def console_script() -> list[str]:
    """The installed `smc-sd` script next to this interpreter (or the same entry point run by it)."""
    script = pathlib.Path(sys.executable).parent / "smc-sd"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from smc_sd.cli import main; sys.exit(main())"]


def timed(argv: list[str], env: dict) -> dict:
    """Run argv once: wall seconds, the child's CPU seconds (user + sys), its stderr."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "stdout": done.stdout, "stderr": done.stderr}


def import_seconds(module: str, env: dict) -> dict:
    """{"wall": s, "cpu": s} of `import module` in a fresh interpreter."""
    code = (f"import time; w, c = time.perf_counter(), time.process_time(); import {module}; "
            "print(time.perf_counter() - w, time.process_time() - c)")
    wall, cpu = map(float, timed([sys.executable, "-c", code], env)["stdout"].split())
    return {"wall": wall, "cpu": cpu}


def median_of(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every timed process (default 1)")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}

    help_runs = [timed(console_script() + ["--help"], env) for _ in range(args.repeats)]
    imports = {}
    for module in IMPORTS:
        runs = [import_seconds(module, env) for _ in range(args.repeats)]
        imports[module] = {"wall_s": median_of(runs, "wall"), "cpu_s": median_of(runs, "cpu")}

    command = readme_first_command()
    argv = console_script() + command[1:]
    # the warm-up: the first run ever converts the default model to fp32 once (README)
    timed(argv, env)
    runs = []
    for _ in range(args.repeats):
        run = timed(argv, env)
        summary = SUMMARY.search(run["stderr"])
        runs.append({"wall": run["wall"], "cpu": run["cpu"], "generation": float(summary.group(2)) if summary else None,
                     "tokens": int(summary.group(1)) if summary else None, "answer": run["stdout"].strip()})
    run = timed(argv + ["--json"], env)
    result = json.loads(run["stdout"])
    phases = {"wall_s": run["wall"], "cpu_s": run["cpu"], "load_s": result["load_seconds"], "generation_s": result["seconds"]}
    phases["rest_s"] = phases["wall_s"] - phases["load_s"] - phases["generation_s"]

    emit("startup", {
        "environment": environment(),
        "threads": args.threads,
        "repeats": args.repeats,
        "help": {"wall_s": median_of(help_runs, "wall"), "cpu_s": median_of(help_runs, "cpu"),
                 "runs_wall_s": [r["wall"] for r in help_runs]},
        "imports": imports,
        "first_command": {
            "command": shlex.join(command),
            "wall_s": median_of(runs, "wall"),
            "cpu_s": median_of(runs, "cpu"),
            "generation_s": median_of(runs, "generation"),
            "runs": runs,
            "phases": phases,
        },
        "goals_s": {"help": 1.0, "first_command": 8.0},
    })


if __name__ == "__main__":
    main()
