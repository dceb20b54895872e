"""GET /metrics: the engine's statistics in Prometheus' text format (version 0.0.4).

    # HELP smc_sd_requests_running Requests whose particles are in the batch.
    # TYPE smc_sd_requests_running gauge
    smc_sd_requests_running 3

Each metric is one entry of `BatchEngine.stats()`, named `smc_sd_<key>`; counters end in _total.
"""

from __future__ import annotations

import math

#: (stats key, Prometheus type, help), in the order /metrics lists them
METRICS = (
    ("requests_running", "gauge", "Requests whose particles are in the batch."),
    ("requests_waiting", "gauge", "Requests queued to join the batch."),
    ("tokens_total", "counter", "Tokens generated, over every particle of every request."),
    ("target_passes_total", "counter", "Target forward passes (each over the particles of every running request)."),
    ("accepted_total", "counter", "Draft tokens accepted by exact speculative decoding and by free drafts' verifies."),
    ("drafted_total", "counter", "Draft tokens proposed by exact speculative decoding and by free drafts."),
    ("ess_mean", "gauge", "Mean of ESS / N over the running requests' last cycles."),
    ("resamples_total", "counter", "Resampling events, over every request."),
    ("kv_blocks_in_use", "gauge", "KV-cache blocks in use, target and draft together."),
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def prometheus_text(stats: dict) -> str:
    """The exposition text of the engine's stats (a value that is not finite is written NaN)."""
    lines = []
    for key, kind, help_text in METRICS:
        value = float(stats[key])
        name = f"smc_sd_{key}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {value:.17g}" if math.isfinite(value) else f"{name} NaN"]
    return "\n".join(lines) + "\n"
