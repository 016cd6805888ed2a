"""The shared contract: what the API, the orchestrator and the workers all read.

The recipe (``contracts.recipe``), overrides (``contracts.overrides``), the checkpoint format
(``contracts.checkpoint``) and the wire types between workers and control plane (``contracts.wire``). This package
imports no torch, no Ray and nothing of ``api``, ``orchestrator`` or ``workers``, so every arrow points into it.
"""
