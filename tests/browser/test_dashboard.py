"""The dashboard in real headless Chromium against a real ``ballast serve``, with auth off and with auth on.

A recipe that recovers (``recipes/unstable-grad-spike.yaml``: a x1e4 gradient spike at step 60 of attempt 1,
rollback to the step-50 checkpoint, attempt 2 succeeds) is submitted from the dashboard's editor; the page
follows it live to the end. Then the run page is opened afresh and what it drew is compared with what the REST
API says: the charts report, from their own draw, the points per attempt and every marker with its position.

Screenshots of the runs page, the run page (1280×800, auth on) and its heat map go to ``docs/screenshots/`` (or
``$BALLAST_SCREENSHOT_DIR``); the README shows them.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import REPO, Server, Watched, sign_in_with_token, wait_for

# a module's first test also starts the server and runs the recipe to its end (about a minute on an idle
# 2-core machine), so the per-test limit is wider than the suite's 300 s
pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

RECOVERING = (REPO / "recipes" / "unstable-grad-spike.yaml").read_text()
SCREENSHOTS = Path(os.environ.get("BALLAST_SCREENSHOT_DIR", REPO / "docs" / "screenshots"))
CHARTS = {"loss": "loss", "grad_norm": "grad_norm", "lr": "lr"}  # chart id → its first (per-attempt) series
# tests that need one auth mode only: they reuse that mode's server (one start per mode in all)
AUTH_ON_ONLY = pytest.mark.parametrize("server", ["auth-on"], indirect=True)
AUTH_OFF_ONLY = pytest.mark.parametrize("server", ["auth-off"], indirect=True)


@dataclass
class Recovered:
    run_id: int
    run: dict[str, Any]
    live_page: Watched
    reloaded: bool


def _attr_json(page: Any, selector: str, name: str) -> Any:
    raw = page.get_attribute(selector, name)
    assert raw is not None, f"{selector} has no {name}"
    return json.loads(raw)


@pytest.fixture(scope="module")
def recovered(context: Any, server: Server) -> Recovered:
    """The recovering recipe, submitted from the editor on the runs page and followed live to SUCCEEDED."""
    page = context.new_page()
    watched = Watched(page, server.url)
    page.goto(server.url + "/")
    if server.auth:
        sign_in_with_token(page, server.token or "")
    page.wait_for_selector("main[data-ready=true] #runs-table")
    page.evaluate("window.__sameDocument = 'yes'")  # gone if anything reloads the page
    page.fill("#recipe-text", RECOVERING)
    page.click("#submit-btn")
    page.wait_for_url(re.compile(r"#/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    page.wait_for_selector("main[data-ready=true] #run-title")
    run = server.wait_terminal(run_id)
    assert run["state"] == "succeeded", (run, server.log_tail())
    # the open page learns the end from the event stream and redraws itself, without a reload
    page.wait_for_selector("main[data-state=succeeded]", timeout=60_000)
    reloaded = page.evaluate("window.__sameDocument") != "yes"
    return Recovered(run_id=run_id, run=run, live_page=watched, reloaded=reloaded)


def _points_per_attempt(server: Server, run_id: int, series: str) -> dict[str, int]:
    metrics = server.get(f"/runs/{run_id}/metrics", series=series, max_points=4000)
    s = metrics["series"][0]
    return {str(a): n for a, n in sorted(Counter(s["attempts"]).items())}


def test_the_submitted_run_is_followed_live_to_its_end(recovered: Recovered, server: Server) -> None:
    page = recovered.live_page.page
    assert not recovered.reloaded, "the page reloaded while following the run"
    assert page.inner_text("#run-title .badge") == "succeeded"
    points = _attr_json(page, "#chart-loss", "data-points")
    assert points == _points_per_attempt(server, recovered.run_id, "loss")
    assert set(points) == {"1", "2"}
    assert page.get_attribute("#live-status", "data-status") == "closed"
    assert recovered.live_page.problems() == {}


def test_run_page_draws_attempts_anomalies_checkpoints_and_the_rollback(
    recovered: Recovered, server: Server, open_page: Any
) -> None:
    run_id = recovered.run_id
    attempts = server.get(f"/runs/{run_id}/attempts")["data"]
    anomalies = server.get(f"/runs/{run_id}/anomalies")["data"]
    checkpoints = server.get(f"/runs/{run_id}/checkpoints")["data"]
    layers = server.get(f"/runs/{run_id}/layers")["data"]
    assert [a["number"] for a in attempts] == [1, 2]
    first, second = attempts
    onset = first["onset_step"]
    assert isinstance(onset, int) and onset >= 60  # the fault fires at step 60
    resumed = next(c for c in checkpoints if c["id"] == second["parent_checkpoint_id"])
    assert resumed["healthy"] and resumed["step"] <= onset

    w = open_page(f"/#/runs/{run_id}")
    page = w.page
    page.wait_for_selector("main[data-ready=true] #chart-loss[data-drawn]")

    # one line per attempt on every chart, with the points the API has for it
    for chart, series in CHARTS.items():
        drawn_points = _attr_json(page, f"#chart-{chart}", "data-points")
        expected = _points_per_attempt(server, run_id, series)
        assert drawn_points == expected, chart
        assert all(n > 0 for n in drawn_points.values()) and set(drawn_points) == {"1", "2"}, chart

    drawn = _attr_json(page, "#chart-loss", "data-drawn")
    width = page.eval_on_selector("#chart-loss .u-over", "e => e.getBoundingClientRect().width")

    # every anomaly has a marker; the one that ended attempt 1 is drawn from its onset step
    assert sorted((m["attempt"], m["step"], m["kind"]) for m in drawn["anomalies"]) == sorted(
        (a["attempt"], a["step"], a["kind"]) for a in anomalies)
    at_onset = [m for m in drawn["anomalies"] if m["attempt"] == 1 and m["onset_step"] == onset]
    assert at_onset, (onset, drawn["anomalies"])
    assert all(0 <= m["onset_x"] <= m["x"] <= width for m in at_onset)
    assert any(m["step"] == 60 and m["kind"] == "grad_norm_spike" for m in drawn["anomalies"])

    # the rollback: from the onset in attempt 1 back to the checkpoint attempt 2 resumed from
    assert [(r["attempt"], r["from_step"], r["to_step"], r["checkpoint_id"]) for r in drawn["rollbacks"]] == [
        (2, onset, resumed["step"], resumed["id"])]
    rollback = drawn["rollbacks"][0]
    assert 0 <= rollback["x1"] < rollback["x0"] <= width  # drawn backwards in steps
    assert [(b["attempt"], b["step"]) for b in drawn["boundaries"]] == [(2, second["resume_step"])]

    # checkpoints coloured by health
    assert sorted((c["step"], c["attempt"], c["healthy"]) for c in drawn["checkpoints"]) == sorted(
        (c["step"], c["attempt"], c["healthy"]) for c in checkpoints)

    # hovering the grad-norm spike shows kind, detector and value against threshold
    spike = next(m for m in _attr_json(page, "#chart-grad_norm", "data-drawn")["anomalies"] if m["step"] == 60)
    box = page.locator("#chart-grad_norm .u-over").bounding_box()
    page.mouse.move(box["x"] + spike["x"], box["y"] + spike["y"])
    tip = page.locator("#chart-grad_norm .tip")
    tip.wait_for(state="visible")
    assert "grad_norm_spike" in tip.inner_text() and "vs threshold" in tip.inner_text()
    # the anomaly table: a row per anomaly, its action as the API has it (none of these was applied clipped)
    cells = page.locator("#anomalies tbody tr td:last-child").all_inner_texts()
    assert sorted(cells) == sorted(a["action"] for a in anomalies)

    # the timeline: each attempt's reason and overrides diff
    timeline = page.inner_text("#timeline")
    assert second["reason"] and second["reason"] in timeline
    for path, (before, after) in second["overrides"].items():
        label = {"clipping.method": "clipping", "optimizer.lr": "lr", "clipping.max_norm": "clip"}.get(path, path)
        assert f"{label} {before} → {after}" in timeline
    # the per-layer heat map over time: one panel per attempt, a column of depth cells per snapshot
    usable = [s for s in layers if s["block_grad_norms"]]
    assert page.get_attribute("#layers .heatmap", "data-snapshots") == str(len(usable))
    heat = _attr_json(page, "#layers .heatmap", "data-drawn")
    by_attempt = Counter(s["attempt"] for s in usable)
    assert set(by_attempt) == {1, 2}
    for number, n in by_attempt.items():
        drawn_attempt = heat["attempts"][str(number)]
        assert drawn_attempt["snapshots"] == n and drawn_attempt["cells"] == n * heat["depth"] > 0, number
        assert page.locator(f"#layers canvas.heat[data-attempt='{number}']").count() == 1
        assert page.locator(f"#layers ul.diagnoses[data-attempt='{number}'] li").count() >= 1
    assert {"what": "resumed", "step": second["resume_step"]} in heat["attempts"]["2"]["marks"]
    assert {"what": "onset", "step": onset} in heat["attempts"]["1"]["marks"]
    assert "apiVersion: ballast/v1" in page.inner_text("#recipe-yaml")

    if server.auth:  # the auth-on module also has a cancelled run: a fuller runs page for the README
        page.mouse.move(0, 0)
        page.evaluate("window.scrollTo(0, 0)")
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "run.png"))
        page.locator("#layers").screenshot(path=str(SCREENSHOTS / "layers.png"))
    assert w.problems() == {}


@AUTH_ON_ONLY  # the download sends the bearer token: the case a plain link could not do
def test_export_model_downloads_the_latest_healthy_checkpoint(
    recovered: Recovered, server: Server, open_page: Any, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    run_id = recovered.run_id
    checkpoints = server.get(f"/runs/{run_id}/checkpoints")["data"]
    healthy = max((c for c in checkpoints if c["healthy"] and not c["deleted"]),
                  key=lambda c: (c["attempt"], c["step"]))
    w = open_page(f"/#/runs/{run_id}")
    page = w.page
    page.wait_for_selector("main[data-ready=true] #run-title")
    page.click("#export-model summary")
    assert page.input_value("#export-checkpoint") == ""  # the server picks the latest healthy one
    with page.expect_download() as info:
        page.click("#export-model-btn")
    download = info.value
    assert download.suggested_filename == f"unstable-grad-spike-run{run_id}-step{healthy['step']}.safetensors"
    path = tmp_path / download.suggested_filename
    download.save_as(str(path))
    weights = load_file(str(path))
    assert weights and all(t.numel() > 0 for t in weights.values())
    page.wait_for_selector("#export-status[data-done]")
    assert f"checkpoint #{healthy['id']} (step {healthy['step']})" in page.inner_text("#export-status")
    assert w.problems() == {}


@AUTH_ON_ONLY  # the actions send the bearer token; with auth off they are the same requests without it
def test_cancel_and_retry_from_the_run_page(server: Server, open_page: Any) -> None:
    long_run = (REPO / "recipes" / "baseline.yaml").read_text().replace("max_steps: 300", "max_steps: 100000")
    long_run = long_run.replace("name: baseline", "name: cancel-me")
    r = server.client.post("/runs", content=long_run, headers={"content-type": "application/yaml"})
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    w = open_page(f"/#/runs/{run_id}")
    page = w.page
    page.wait_for_selector("main[data-ready=true] #run-title")
    # live: the page sees the run start and its first metrics arrive, with no reload
    page.wait_for_selector("main[data-state=running]", timeout=120_000)
    page.wait_for_selector("#chart-loss:not(.empty)", timeout=120_000)
    page.click("#cancel-btn")
    assert page.inner_text("#cancel-btn") == "Confirm cancel"
    page.click("#cancel-btn")
    assert server.wait_terminal(run_id, timeout=120)["state"] == "cancelled"
    page.wait_for_selector("main[data-state=cancelled]", timeout=30_000)

    page.click("#retry summary")
    page.fill("#retry-lr", "0.001")
    page.fill("#retry-set", "training.max_steps=100001")
    page.click("#retry button[type=submit]")
    page.wait_for_selector("#timeline li[data-attempt='2']", timeout=30_000)
    second = server.get(f"/runs/{run_id}/attempts/2")
    assert second["kind"] == "manual"
    assert second["overrides"]["optimizer.lr"][1] == 0.001
    assert second["overrides"]["training.max_steps"][1] == 100001
    server.client.post(f"/runs/{run_id}/cancel")  # free the CPUs
    server.wait_terminal(run_id, timeout=120)
    assert w.problems() == {}


def test_runs_page_lists_filters_and_links_the_run(recovered: Recovered, server: Server, open_page: Any) -> None:
    w = open_page("/")
    page = w.page
    row = f"#runs-table tr[data-run-id='{recovered.run_id}']"
    page.wait_for_selector(row)
    cells = page.locator(f"{row} td, {row} th").all_inner_texts()
    summary = recovered.run["summary"]
    assert cells[0].startswith("unstable-grad-spike")
    assert cells[1:6] == ["succeeded", "2", str(summary["retries_used"]), str(summary["anomalies_total"]),
                          _fmt(summary["best_loss"])]
    assert re.fullmatch(r"\d+(\.\d+)?(e-?\d+)?", cells[6]), cells  # final loss is a number
    assert page.get_attribute(f"{row} a.run-link", "href") == f"#/runs/{recovered.run_id}"

    page.select_option("#state-filter", "failed")
    page.wait_for_selector(f"{row}", state="detached")
    page.wait_for_selector("#runs-table td.empty")
    page.select_option("#state-filter", "succeeded")
    page.wait_for_selector(row)
    page.select_option("#state-filter", "")
    page.wait_for_selector(row)

    shown = " ".join(page.inner_text("#auth").split())
    assert shown == (f"token …{(server.token or '')[-4:]} Forget token" if server.auth else "auth off")
    # every run the API lists is a row with its state (with auth on, the cancelled one of the test above)
    for run in server.get("/runs")["data"]:
        badge = page.locator(f"#runs-table tr[data-run-id='{run['id']}'] .badge")
        assert badge.inner_text() == run["state"], run["id"]

    if server.auth:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "runs.png"))

    # keyboard: Tab reaches the run's link, Enter opens the run page (no reload)
    page.evaluate("window.__sameDocument = 'yes'")
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement?.getAttribute('href')") == f"#/runs/{recovered.run_id}":
            break
    else:
        pytest.fail("Tab never reached the run link")
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(rf"#/runs/{recovered.run_id}$"))
    page.wait_for_selector("main[data-ready=true] #run-title")
    assert page.evaluate("window.__sameDocument") == "yes"
    assert w.problems() == {}


def _fmt(v: float) -> str:
    """The dashboard's number format for an ordinary value: 4 significant digits."""
    return f"{float(f'{v:.4g}'):g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}".replace("e+", "e")


@AUTH_OFF_ONLY
def test_a_skip_applied_clipped_is_shown_as_applied(server: Server, open_page: Any) -> None:
    """The anomaly table's and the chart tooltip's action text (``actionText``, the page's own module): a finding
    whose recurring skip was applied clipped (``details.applied_clipped_to``) does not read as a discarded step."""
    w = open_page("/")
    page = w.page
    page.wait_for_selector("main[data-ready=true]")
    texts = page.evaluate("""async () => {
      const { actionText } = await import('/static/dashboard/util.js');
      return [
        actionText({ action: 'skip_step', details: {} }),
        actionText({ action: 'skip_step', details: { applied_clipped_to: 0.4231 } }),
        actionText({ action: 'skip_step', details: { applied_clipped_to: 'NaN' } }),
        actionText({ action: 'rollback' }),
      ];
    }""")
    assert texts == ["skip_step", "skip_step → applied, clipped to 0.4231", "skip_step", "rollback"]
    assert w.problems() == {}


def test_editor_shows_validation_errors_next_to_their_lines(server: Server, open_page: Any) -> None:
    lines = RECOVERING.splitlines()
    lr_line = next(i for i, line in enumerate(lines, 1) if line.strip() == "lr: 0.1")
    bad = "\n".join(line.replace("lr: 0.1", "lr: -0.1") for line in lines)
    w = open_page("/")
    page = w.page
    page.wait_for_selector("main[data-ready=true] #recipe-text")
    page.fill("#recipe-text", bad)
    page.click("#validate-btn")
    msg = page.locator(f".marks .msg[data-line='{lr_line}']")
    msg.wait_for()
    assert "optimizer.lr" in msg.inner_text() and "greater than 0" in msg.inner_text()
    assert page.locator(".gutter div.bad").all_inner_texts() == [str(lr_line)]
    assert page.inner_text("#recipe-errors").startswith(f"line {lr_line}: optimizer.lr")
    # the message sits on the line it names: same row as that line of the text
    row_top = page.eval_on_selector(f".marks div[data-line='{lr_line}']", "e => e.offsetTop")
    line_height = page.eval_on_selector("#recipe-text", "e => parseFloat(getComputedStyle(e).lineHeight)")
    pad = page.eval_on_selector("#recipe-text", "e => parseFloat(getComputedStyle(e).paddingTop)")
    assert row_top == pytest.approx(pad + (lr_line - 1) * line_height, abs=1)
    # the 422 is the answer the page asked for; the browser logs it as a failed resource and nothing else
    assert len(w.console_errors) == 1 and "422" in w.console_errors[0], w.console_errors
    assert w.page_errors == [] and w.foreign_requests == []

    page.fill("#recipe-text", RECOVERING)
    page.click("#validate-btn")
    page.wait_for_selector("#recipe-result .ok")
    assert page.locator(".marks .msg").count() == 0


def test_narrow_window_has_no_sideways_scroll(recovered: Recovered, context: Any, open_page: Any) -> None:
    w = open_page(f"/#/runs/{recovered.run_id}")
    page = w.page
    page.set_viewport_size({"width": 420, "height": 800})
    page.wait_for_selector("main[data-ready=true] #chart-loss[data-drawn]")
    wait_for(lambda: page.eval_on_selector("#chart-loss canvas", "c => c.getBoundingClientRect().width <= 420"),
             timeout=10, what="the chart to fit the narrow window")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert w.problems() == {}


@AUTH_ON_ONLY
def test_token_is_asked_once_and_kept_for_the_tab(server: Server, open_page: Any) -> None:
    w = open_page("/", sign_in=False)
    page = w.page
    page.wait_for_selector("#token-form")  # asked before any API call: no 401 on the way
    assert w.problems() == {}
    sign_in_with_token(page, server.token or "")
    page.wait_for_selector("main[data-ready=true] #runs-table")
    assert page.evaluate("sessionStorage.getItem('ballast.token')") == server.token
    page.reload()  # the token lives as long as the tab
    page.wait_for_selector("main[data-ready=true] #runs-table")
    assert page.locator("#token-form").count() == 0
    assert w.problems() == {}

    other = open_page("/", sign_in=False)  # a new tab asks again
    other.page.wait_for_selector("#token-form")
    other.page.fill("#token-input", "blst_not-a-real-token")
    other.page.click("#token-form button[type=submit]")
    other.page.wait_for_selector("#token-form h1:text('The token was refused')")
    assert all("401" in e for e in other.console_errors) and other.console_errors


@AUTH_OFF_ONLY  # the docs pages are the same whatever the auth mode
def test_api_docs_work_with_no_network(server: Server, open_page: Any) -> None:
    w = open_page("/docs", sign_in=False)
    w.page.wait_for_selector(".swagger-ui .opblock")
    assert w.page.locator(".opblock").count() >= 10
    w.page.goto(server.url + "/redoc")
    w.page.wait_for_selector("redoc .menu-content")
    w.page.wait_for_selector("redoc h1:has-text('Ballast')")
    w.page.wait_for_selector("redoc h2:has-text('Submit a recipe as a new run')")
    assert w.problems() == {}
