"""The planner's estimate next to what a run measured, logged after its first step."""

from __future__ import annotations

from typing import Any

from shardforge.log import get_logger

log = get_logger(__name__)
MIB = 1 << 20


def planned_vs_measured(estimate: Any, measured: dict[str, int]) -> dict[str, Any]:
    """Logs a line, and returns the first record's fields: model-state bytes (measured by memory_report
    on this rank, the fullest rank's estimate) and the estimated step time and activations (the measured step
    time follows in the record as step_time_s; `step_time_ratio` is measured / planned there)."""
    shown = {k: f"{v / MIB:.1f} MiB" for k, v in measured.items()}
    line = f"model-state memory on rank 0 after the first step: {shown}"
    if estimate is None or estimate.memory is None:
        log.info(line)
        return dict(measured)
    states = estimate.memory.states
    planned = {"param_bytes": states.params, "grad_bytes": states.grads, "optim_bytes": states.optimizer}
    ratios = {k: measured[k] / v for k, v in planned.items() if v and k in measured}
    fields = {
        **measured,
        **{f"planned_{k}": v for k, v in planned.items()},
        "planned_activation_bytes": estimate.memory.activations,
        "planned_step_time_s": estimate.time.total,
    }
    line += "; planner: " + ", ".join(f"{k} {planned[k] / MIB:.1f} MiB (x{r:.3f})" for k, r in ratios.items())
    line += (
        f", activations {estimate.memory.activations / MIB:.1f} MiB, step {estimate.time.total:.3g} s "
        f"(measured / planned in the first record: step_time_ratio)"
    )
    log.info(line)
    return fields
