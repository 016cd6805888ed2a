"""What the trackers receive: the queued event, the scalars of each event type, the text lines of anomalies,
checkpoints and attempt boundaries, and the ``Exporter`` protocol the TensorBoard and MLflow writers follow."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

ATTEMPT_START = "_attempt_start"
"""The queue's own event: an attempt's first line (attempt, resume point), written before its events."""


@dataclass(frozen=True)
class Event:
    attempt: int
    type: str
    data: Mapping[str, Any]
    ts_ms: int


# ------------------------------------------------------------------------------------------ the series
def as_number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


METRIC_SERIES = (("loss", "loss"), ("grad_norm", "grad_norm/pre_clip"), ("grad_norm_clipped", "grad_norm/post_clip"),
                 ("lr", "lr"), ("loss_scale", "loss_scale"), ("throughput", "throughput"))
"""``metric`` payload key → series name."""


def scalars(type: str, data: Mapping[str, Any]) -> dict[str, float]:
    """The scalar series one event contributes (non-finite and missing values left out)."""
    out: dict[str, float] = {}
    if type == "metric":
        pairs: Iterable[tuple[str, Any]] = ((name, data.get(key)) for key, name in METRIC_SERIES)
    elif type == "eval":
        pairs = ((k if k.startswith("eval") else f"eval/{k}", v) for k, v in data.items() if k != "step")
    elif type == "layer_stats":
        layers = data.get("layer_grad_norms") or {}
        blocks = data.get("block_grad_norms") or []
        pairs = [("update_ratio", data.get("update_ratio")),
                 *((f"layer_grad_norm/{name}", v) for name, v in layers.items()),
                 *((f"block_grad_norm/{i:02d}", v) for i, v in enumerate(blocks))]
    else:
        return out
    for name, value in pairs:
        v = as_number(value)
        if v is not None:
            out[name] = v
    return out


def fmt(x: Any) -> str:
    v = as_number(x)
    return "n/a" if v is None else f"{v:.6g}"


def anomaly_line(d: Mapping[str, Any]) -> str:
    return (f"step {d.get('step')}: {d.get('kind')} ({d.get('detector')}) value {fmt(d.get('value'))} "
            f"vs threshold {fmt(d.get('threshold'))}, action {d.get('action')}")


def checkpoint_line(d: Mapping[str, Any]) -> str:
    health = "healthy" if d.get("healthy") else "UNHEALTHY"
    verdict = d.get("verdict") or {}
    failed = [k for k, v in verdict.items() if v is False]
    why = f" ({', '.join(failed)} failed)" if failed else ""
    return f"step {d.get('step')}: {health}{why}, sha256 {str(d.get('sha256') or '')[:12]}, {d.get('uri')}"


def end_line(d: Mapping[str, Any]) -> str:
    onset = f", onset step {d['onset_step']}" if d.get("onset_step") is not None else ""
    reason = f": {d['reason']}" if d.get("reason") else ""
    return f"ended {d.get('outcome')} after step {d.get('final_step')}{onset}{reason}"


def start_line(d: Mapping[str, Any]) -> str:
    resumed = f"resumed from {d['resume_from']}" if d.get("resume_from") else "from initialisation"
    rewarm = f", LR re-warm over {d['rewarm_steps']} steps" if d.get("rewarm_steps") else ""
    offset = f", data offset {d['data_offset']}" if d.get("data_offset") else ""
    return f"attempt {d.get('attempt')} {resumed}{rewarm}{offset}"


def event_step(d: Mapping[str, Any]) -> int:
    step = d.get("step", d.get("final_step", 0))
    return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else 0


# ------------------------------------------------------------------------------------------ exporters
class Exporter(Protocol):
    name: str

    def write(self, events: list[Event]) -> None: ...

    def close(self, final: Event | None) -> None: ...
