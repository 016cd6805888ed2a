"""``/runs/{run_id}/layers``: the per-layer gradient-norm profile by depth, as the store keeps it.

The store keeps the newest ``layer_stats`` snapshot of each attempt (``attempts.ray_info``, see
``orchestrator/store/ingest.py``), so this lists one snapshot per attempt that reported one, not a history.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.auth import ReadableRun
from api.deps import SessionDep
from api.errors import problem_responses
from api.schemas import LayerSnapshot, Page
from orchestrator.store import repo

router = APIRouter(tags=["metrics"])


def _snapshot(attempt: int, raw: dict[str, Any]) -> LayerSnapshot | None:
    step = raw.get("step")
    if not isinstance(step, int):
        return None
    blocks = raw.get("block_grad_norms")
    layers = raw.get("layer_grad_norms")
    return LayerSnapshot.model_validate({
        "attempt": attempt,
        "step": step,
        "block_grad_norms": list(blocks) if isinstance(blocks, list) else [],
        "layer_grad_norms": dict(layers) if isinstance(layers, dict) else {},
        "update_ratio": raw.get("update_ratio"),
        "diagnosis": raw.get("diagnosis") if isinstance(raw.get("diagnosis"), str) else None,
    })


@router.get(
    "/runs/{run_id}/layers",
    summary="Per-layer gradient norms by depth (newest snapshot of each attempt)",
    description="One entry per attempt that reported per-layer statistics (`telemetry.layer_stats_every`), in "
    "attempt order: the newest snapshot the store keeps for it. `next` is always null.",
    responses=problem_responses(401, 403, 404, 422),
)
def list_layer_snapshots(run: ReadableRun, session: SessionDep) -> Page[LayerSnapshot]:
    out = []
    for att in repo.list_attempts(session=session, run_id=run.id):
        raw = (att.ray_info or {}).get("layer_stats")
        snap = _snapshot(att.number, raw) if isinstance(raw, dict) else None
        if snap is not None:
            out.append(snap)
    return Page[LayerSnapshot](data=out, count=len(out), next=None)
