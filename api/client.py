"""The Ballast client: one typed client for the REST API (``/api/v1``), public as ``ballast.Client`` and used by
the ``ballast`` CLI. (One class of ~470 lines on purpose: one method per endpoint, each a few lines, so a user
reads the whole API surface in one place; the shapes live in ``api/schemas.py``.)

It speaks plain JSON dicts (the server's response models, ``api/schemas.py``, are the contract: ``RunRead`` /
``RunDetail``, ``AttemptRead``, ``CheckpointRead``, ...) and turns every failure into one of three exceptions with
a message a person can act on: ``ApiError`` (the server answered with a problem+json document; ``lines()``
renders it one line per field error), ``Unreachable`` (nothing answered at the URL) and ``WaitTimeout``
(``wait`` gave up before the run ended). ``export`` reads a checkpoint's files and so needs torch (imported only
when it is called)::

    from ballast import Client

    with Client("http://127.0.0.1:8420") as client:
        run = client.submit(Path("recipes/unstable-grad-spike.yaml"))
        run = client.wait(run["id"], timeout=600)
        client.export(run["id"], "out/", format="safetensors")
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

DEFAULT_URL = "http://127.0.0.1:8420"
API_PREFIX = "/api/v1"
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
"""Run states after which nothing changes (``orchestrator.policy.states.TERMINAL_RUN_STATES``)."""
ExportFormat = Literal["state_dict", "safetensors", "hf"]
RecipeSource = str | bytes | Path | Mapping[str, Any]
"""A recipe as ``submit`` takes it: YAML text (str or bytes), a file (``Path``) or a document (a mapping)."""

# Transient failures after the request may have reached the server: safe to resend only when the request is
# idempotent (a GET, or a POST /runs carrying an Idempotency-Key).
_RETRY_STATUS = frozenset({502, 503, 504})
_RETRY_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout, httpx.WriteError)


class ClientError(Exception):
    """Base of the errors the CLI renders (never a traceback)."""

    def lines(self) -> list[str]:
        return [str(self)]


class Unreachable(ClientError):
    """Nothing answered at the base URL (connection refused, DNS failure, connect timeout)."""

    def __init__(self, url: str, cause: str) -> None:
        self.url, self.cause = url, cause
        super().__init__(f"cannot reach Ballast at {url}: is `ballast serve` running? ({cause})")


class ApiError(ClientError):
    """The server refused the request; ``problem`` is its RFC 9457 document (or a stand-in built from the body)."""

    def __init__(self, status: int, problem: Mapping[str, Any]) -> None:
        self.status = status
        self.problem = dict(problem)
        super().__init__("; ".join(self.lines()))

    @property
    def title(self) -> str:
        return str(self.problem.get("title") or httpx.codes.get_reason_phrase(self.status) or "error")

    @property
    def field_errors(self) -> list[dict[str, Any]]:
        errs = self.problem.get("errors")
        return [e for e in errs if isinstance(e, dict)] if isinstance(errs, list) else []

    def lines(self) -> list[str]:
        """One line per field error (``path: message (line N)``), else ``title (status): detail``."""
        out = []
        for e in self.field_errors:
            line = e.get("line")
            where = f" (line {line})" if line else ""
            out.append(f"{e.get('path') or '<request>'}: {e.get('message', 'invalid')}{where}")
        if out:
            return out
        detail = self.problem.get("detail")
        head = f"{self.title} ({self.status})"
        return [f"{head}: {detail}" if detail and detail != self.title else head]


def _problem_of(resp: httpx.Response) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        text = resp.text.strip()
        return {"detail": text[:500]} if text else {}
    if isinstance(body, dict):
        if "detail" in body and isinstance(body["detail"], list):
            # FastAPI's default 422 shape, in case an endpoint bypasses the problem+json handler
            errs = [
                {"path": ".".join(str(p) for p in d.get("loc", [])), "message": d.get("msg", "invalid")}
                for d in body["detail"]
                if isinstance(d, dict)
            ]
            return {"title": "Unprocessable Content", "errors": errs}
        return body
    return {"detail": str(body)[:500]}


class WaitTimeout(ClientError, TimeoutError):
    """``wait`` ran out of time; ``run`` is the run as last seen (still active)."""

    def __init__(self, run: Mapping[str, Any], timeout: float) -> None:
        self.run = dict(run)
        super().__init__(f"run {run.get('id')} is still {run.get('state')} after {timeout:g}s")


@dataclass(frozen=True)
class Submitted:
    """A submitted run; ``created`` is False when the Idempotency-Key matched an earlier submission."""

    run: dict[str, Any]
    created: bool


class Client:
    """The REST endpoints as methods. ``base_url`` is the server root (``/api/v1`` is appended; default
    ``BALLAST_URL`` or ``http://127.0.0.1:8420``); ``token`` a bearer token (default ``BALLAST_TOKEN``).

    GETs (and a submit, which always carries an ``Idempotency-Key``) are resent after a transient failure
    (``retries`` times). Use it as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 15.0,
        transport: httpx.BaseTransport | None = None,
        retries: int = 2,
    ) -> None:
        url = (base_url or os.environ.get("BALLAST_URL") or DEFAULT_URL).rstrip("/")
        if url.endswith(API_PREFIX):
            url = url[: -len(API_PREFIX)]
        self.base_url = url
        token = token if token is not None else os.environ.get("BALLAST_TOKEN")
        headers = {"Accept": "application/json, application/problem+json", "User-Agent": "ballast-cli"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.retries = retries
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout, transport=transport)

    # ------------------------------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        idempotent: bool | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        clean = {k: v for k, v in (params or {}).items() if v is not None}
        idempotent = method == "GET" if idempotent is None else idempotent
        attempts = 1 + (self.retries if idempotent else 0)
        for i in range(attempts):
            try:
                resp = self._http.request(method, path, params=clean, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                raise Unreachable(self.base_url, _short(exc)) from None
            except _RETRY_ERRORS as exc:
                if i + 1 < attempts:
                    time.sleep(0.2 * 2**i)
                    continue
                raise Unreachable(self.base_url, _short(exc)) from None
            if resp.status_code in _RETRY_STATUS and i + 1 < attempts:
                time.sleep(0.2 * 2**i)
                continue
            if resp.status_code >= 400:
                raise ApiError(resp.status_code, _problem_of(resp))
            return resp
        raise AssertionError("unreachable")  # pragma: no cover - the loop always returns or raises

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self._request(method, API_PREFIX + path, **kwargs)
        if not resp.content:
            return {}
        try:
            return resp.json()
        except ValueError:
            bad = {"title": "Bad response", "detail": "the server did not send JSON"}
            raise ApiError(resp.status_code, bad) from None

    # ------------------------------------------------------------------------------------------- recipes
    def validate_recipe(self, text: bytes | str) -> dict[str, Any]:
        """The normalised recipe with defaults filled; ApiError with field errors if invalid."""
        data: dict[str, Any] = self._json(
            "POST", "/recipes:validate", content=_bytes(text), headers={"Content-Type": "application/yaml"},
            idempotent=True,
        )
        return data

    # ---------------------------------------------------------------------------------------------- runs
    def submit_run(self, text: bytes | str, *, idempotency_key: str | None = None) -> Submitted:
        """Queue a run from recipe YAML. A key (generated if absent) makes resending the request safe."""
        key = idempotency_key or f"cli-{uuid.uuid4()}"
        resp = self._request(
            "POST",
            API_PREFIX + "/runs",
            content=_bytes(text),
            headers={"Content-Type": "application/yaml", "Idempotency-Key": key},
            idempotent=True,
        )
        return Submitted(run=resp.json(), created=resp.status_code == 201)

    def submit(self, recipe: RecipeSource, *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Queue a run → the run (``RunRead``). ``recipe``: YAML text, a ``Path`` to a YAML file, or a document
        (a mapping, sent as JSON). An ``ApiError`` with one field error per problem if it is invalid."""
        key = idempotency_key or f"sdk-{uuid.uuid4()}"
        if isinstance(recipe, Mapping):
            content, media = json.dumps(dict(recipe)).encode(), "application/json"
        elif isinstance(recipe, Path):
            content, media = recipe.read_bytes(), "application/yaml"
        else:
            content, media = _bytes(recipe), "application/yaml"
        resp = self._request("POST", API_PREFIX + "/runs", content=content,
                             headers={"Content-Type": media, "Idempotency-Key": key}, idempotent=True)
        data: dict[str, Any] = resp.json()
        return data

    def wait(self, run_id: str | int, *, timeout: float | None = None, poll: float = 1.0) -> dict[str, Any]:
        """Poll until the run is succeeded, failed or cancelled → the run (``RunDetail``); ``WaitTimeout`` when
        ``timeout`` seconds pass first (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            run = self.get_run(run_id)
            if run.get("state") in TERMINAL_STATES:
                return run
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(run, float(timeout or 0))
            pause = poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic()))
            time.sleep(pause)

    def list_runs(
        self,
        *,
        state: str | list[str] | None = None,
        name: str | None = None,
        owner: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        data: dict[str, Any] = self._json(
            "GET", "/runs", params={"state": state, "name": name, "owner": owner, "limit": limit, "cursor": cursor}
        )
        return data

    def runs(
        self, *, state: str | list[str] | None = None, name: str | None = None, owner: str | None = None,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """Every run matching the filters, newest first, following the cursor (at most ``limit`` runs)."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while limit is None or len(out) < limit:
            page = self.list_runs(state=state, name=name, owner=owner, cursor=cursor,
                                  limit=None if limit is None else min(100, limit - len(out)))
            out.extend(_items(page))
            cursor = page.get("next")
            if not cursor:
                break
        return out

    def get_run(self, run_id: str | int) -> dict[str, Any]:
        """One run with its current attempt, summary and normalised recipe (``RunDetail``)."""
        data: dict[str, Any] = self._json("GET", f"/runs/{_seg(run_id)}")
        return data

    get = get_run

    def cancel_run(self, run_id: str | int) -> dict[str, Any]:
        """Ask the scheduler to stop the run (its Ray work stops within seconds) → the run."""
        data: dict[str, Any] = self._json("POST", f"/runs/{_seg(run_id)}/cancel")
        return data

    cancel = cancel_run

    def retry_run(self, run_id: str | int, *, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A manual retry of an ended run from its best healthy checkpoint, with optional overrides
        (``{"optimizer.lr": 1e-4}``) → the run."""
        data: dict[str, Any] = self._json(
            "POST", f"/runs/{_seg(run_id)}/retry", json={"overrides": dict(overrides or {})}
        )
        return data

    retry = retry_run

    def attempts(self, run_id: str | int) -> list[dict[str, Any]]:
        """The run's attempts, oldest first (``AttemptRead``: kind, overrides, plan, reason, outcome)."""
        return _items(self._json("GET", f"/runs/{_seg(run_id)}/attempts"))

    def checkpoints(self, run_id: str | int) -> list[dict[str, Any]]:
        """The run's checkpoints (``CheckpointRead``: attempt, step, uri, sha256, healthy, verdict, deleted)."""
        return _items(self._json("GET", f"/runs/{_seg(run_id)}/checkpoints"))

    def export(
        self, run_id: str | int, dest: str | Path, *, format: ExportFormat = "state_dict",
        checkpoint: int | None = None, step: int | None = None, allowed_import_modules: list[str] | None = None,
    ) -> dict[str, Any]:
        """Write the model's weights from one of the run's checkpoints into ``dest`` → what ``export.json`` says.

        Default checkpoint: the run's latest healthy one (else ``checkpoint`` id or ``step``). ``format``:
        ``state_dict`` (``model.pt``), ``safetensors`` (``model.safetensors``) or ``hf`` (``save_pretrained``;
        Hugging Face models only). The checkpoint is verified first, and the weights must load with
        ``strict=True`` into the recipe's model, rebuilt here (a custom model's module must be in
        ``allowed_import_modules``, default ``BALLAST_ALLOWED_IMPORT_MODULES``). Needs torch (``ballast.export``)."""
        from ballast.export import export_run

        return export_run(self, run_id, Path(dest), format=format, checkpoint_id=checkpoint, step=step,
                          allowed_import_modules=allowed_import_modules)

    def download_model(
        self, run_id: str | int, dest: str | Path, *, format: Literal["safetensors", "state_dict"] = "safetensors",
        checkpoint: int | None = None, step: int | None = None,
    ) -> Path:
        """The server's export (``GET /runs/{id}/export``) streamed into ``dest`` (a file, or a directory to put
        the server's file name in) → the path written. Unlike ``export`` it needs no torch and no access to the
        checkpoint storage here: the server verifies the checkpoint and builds the file."""
        params = {k: v for k, v in {"format": format, "checkpoint": checkpoint, "step": step}.items()
                  if v is not None}
        target = Path(dest)
        with self._http.stream("GET", f"{API_PREFIX}/runs/{_seg(run_id)}/export", params=params) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise ApiError(resp.status_code, _problem_of(resp))
            if target.is_dir():
                target = target / (resp.headers.get("content-disposition", "").rpartition("filename=")[2]
                                   .strip('"') or f"model.{'pt' if format == 'state_dict' else 'safetensors'}")
            with target.open("wb") as f:
                for chunk in resp.iter_bytes(1 << 20):
                    f.write(chunk)
        return target

    def anomalies(
        self,
        run_id: str | int,
        *,
        kind: str | None = None,
        attempt: int | None = None,
        step_min: int | None = None,
        step_max: int | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """One page of the run's anomalies, in detection order: ``{"data": [...], "next": cursor}``
        (``all_anomalies`` follows the cursor)."""
        data: dict[str, Any] = self._json(
            "GET",
            f"/runs/{_seg(run_id)}/anomalies",
            params={
                "kind": kind, "attempt": attempt, "step_min": step_min, "step_max": step_max,
                "limit": limit, "cursor": cursor,
            },
        )
        return data

    def all_anomalies(self, run_id: str | int, **filters: Any) -> list[dict[str, Any]]:
        """Every anomaly matching the filters, following the cursor through all pages."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self.anomalies(run_id, cursor=cursor, **filters)
            out.extend(_items(page))
            cursor = page.get("next") if isinstance(page, dict) else None
            if not cursor:
                return out

    def metrics(
        self,
        run_id: str | int,
        *,
        series: str | list[str] | tuple[str, ...] = ("loss",),
        max_points: int | None = None,
        step_min: int | None = None,
        step_max: int | None = None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        """Metric series (loss, grad_norm, lr, ...), each downsampled to ``max_points`` with every bucket's min
        and max kept: ``{"series": [{"name", "steps", "values", "attempts"}, ...]}``."""
        data: dict[str, Any] = self._json(
            "GET",
            f"/runs/{_seg(run_id)}/metrics",
            params={
                "series": [series] if isinstance(series, str) else list(series),
                "max_points": max_points, "step_min": step_min, "step_max": step_max,
                "attempt": attempt,
            },
        )
        return data

    def layers(self, run_id: str | int, *, attempt: int | None = None,
               after_step: int | None = None) -> list[dict[str, Any]]:
        """Every per-layer snapshot (``LayerSnapshot``: attempt, step, block_grad_norms, diagnosis) in (attempt,
        step) order, following the cursor; ``attempt`` / ``after_step`` narrow it."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            page = self._json("GET", f"/runs/{_seg(run_id)}/layers",
                              params={"attempt": attempt, "after_step": after_step, "limit": 1000, "cursor": cursor})
            out.extend(_items(page))
            cursor = page.get("next") if isinstance(page, dict) else None
            if not cursor:
                return out

    def health(self) -> dict[str, Any]:
        resp = self._request("GET", "/healthz")
        data: dict[str, Any] = resp.json()
        return data


BallastClient = Client
"""The client's former name (the CLI's modules and older scripts)."""


def _bytes(text: bytes | str) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else text


def _seg(run_id: str | int) -> str:
    from urllib.parse import quote

    return quote(str(run_id), safe="")


def _items(body: Any) -> list[dict[str, Any]]:
    """A list endpoint's items, whether it answers ``{"data": [...]}`` or a bare list."""
    if isinstance(body, dict):
        body = body.get("data", [])
    return [x for x in body if isinstance(x, dict)] if isinstance(body, list) else []


def _short(exc: Exception) -> str:
    msg = str(exc).strip() or type(exc).__name__
    # httpx wraps OS errors as "[Errno 111] Connection refused": keep the human part
    if "] " in msg and msg.startswith("[Errno"):
        msg = msg.split("] ", 1)[1]
    return msg.splitlines()[0][:200]
