// The runs page: the runs table (filter by state, live refresh) and the recipe editor to submit a new run.

import { api, ApiError } from './api.js';
import { mountEditor } from './editor.js';
import { el, fill, fmt, fmtDuration, fmtTime, RUN_STATES, stateBadge, TERMINAL } from './util.js';

const REFRESH_MS = 3000;
const finalLossCache = new Map(); // run id → final loss of a finished run (it no longer changes)

export function mountRunsPage(root) {
  const params = new URLSearchParams(sessionStorage.getItem('ballast.runs.filter') || '');
  let state = params.get('state') || '';
  let live = params.get('live') !== '0';
  let timer = null;
  let alive = true;
  let loading = false;

  const stateSelect = el('select', { id: 'state-filter', name: 'state' },
    el('option', { value: '' }, 'all states'),
    RUN_STATES.map((s) => el('option', { value: s, selected: s === state }, s)));
  const liveBox = el('input', { type: 'checkbox', id: 'live-refresh', checked: live });
  const status = el('span', { class: 'muted', id: 'runs-status', 'aria-live': 'polite' }, 'loading…');
  const body = el('tbody', {});
  const table = el('table', { class: 'runs', id: 'runs-table' },
    el('caption', { class: 'sr-only' }, 'Runs, newest first'),
    el('thead', {}, el('tr', {},
      ['Name', 'State', 'Attempts', 'Retries', 'Anomalies', 'Best loss', 'Final loss', 'Started', 'Duration']
        .map((h, i) => el('th', { scope: 'col', class: i >= 2 && i <= 6 ? 'num' : null }, h)))),
    body);

  const editorHost = el('div', {});
  fill(root,
    el('section', { class: 'panel', 'aria-labelledby': 'runs-h' },
      el('div', { class: 'panel-head' },
        el('h1', { id: 'runs-h' }, 'Runs'),
        el('div', { class: 'controls' },
          el('label', { for: 'state-filter' }, 'State '), stateSelect,
          el('label', { class: 'check', for: 'live-refresh' }, liveBox, ' live refresh'),
          status)),
      el('div', { class: 'scroll-x' }, table)),
    el('section', { class: 'panel', 'aria-labelledby': 'submit-h' },
      el('h2', { id: 'submit-h' }, 'Submit a recipe'),
      editorHost));
  const unmountEditor = mountEditor(editorHost, {
    onSubmitted: (run) => { location.hash = `#/runs/${run.id}`; },
  });

  function remember() {
    const p = new URLSearchParams();
    if (state) p.set('state', state);
    if (!live) p.set('live', '0');
    sessionStorage.setItem('ballast.runs.filter', p.toString());
  }

  async function load() {
    if (loading) return;
    loading = true;
    try {
      const q = new URLSearchParams({ limit: '50' });
      if (state) q.append('state', state);
      const page = await api(`/runs?${q}`);
      if (!alive) return;
      const losses = await Promise.all(page.data.map(finalLoss));
      if (!alive) return;
      fill(body, page.data.length
        ? page.data.map((run, i) => row(run, losses[i]))
        : el('tr', {}, el('td', { colspan: 9, class: 'empty' },
          state ? `No ${state} runs.` : 'No runs yet: submit a recipe below.')));
      const shown = page.data.length < page.count ? `${page.data.length} of ${page.count}` : `${page.count}`;
      fill(status, `${shown} run${page.count === 1 ? '' : 's'}${live ? ' · live' : ''}`);
      root.dataset.ready = 'true';
    } catch (err) {
      if (!alive) return;
      fill(status, el('span', { class: 'error' }, errorText(err)));
    } finally {
      loading = false;
      schedule();
    }
  }

  function schedule() {
    clearTimeout(timer);
    if (alive && live) timer = setTimeout(load, REFRESH_MS);
  }

  stateSelect.addEventListener('change', () => { state = stateSelect.value; remember(); load(); });
  liveBox.addEventListener('change', () => { live = liveBox.checked; remember(); if (live) load(); else schedule(); });
  load();
  return () => { alive = false; clearTimeout(timer); unmountEditor(); };
}

function errorText(err) {
  if (err instanceof ApiError) return `${err.status}: ${err.message}`;
  return `cannot reach the server (${err.message})`;
}

/** The loss at the newest step of the current attempt (the summary has only the best loss). */
async function finalLoss(run) {
  if (finalLossCache.has(run.id)) return finalLossCache.get(run.id);
  const step = run.summary.last_step;
  if (step === null || step === undefined || !run.current_attempt) return null;
  // last_step counts a finished attempt's completed steps (one past its final 0-based step)
  const q = new URLSearchParams({
    series: 'loss', attempt: String(run.current_attempt), step_min: String(Math.max(0, step - 1)),
  });
  let value = null;
  try {
    const m = await api(`/runs/${run.id}/metrics?${q}`);
    const s = m.series[0];
    value = s && s.values.length ? s.values[s.values.length - 1] : null;
  } catch { return null; }
  if (TERMINAL.has(run.state)) finalLossCache.set(run.id, value);
  return value;
}

function row(run, loss) {
  const s = run.summary;
  const retries = s.crash_restarts_used ? `${s.retries_used} (+${s.crash_restarts_used} restarts)` : s.retries_used;
  const anomalies = Object.entries(s.anomalies_by_kind).map(([k, n]) => `${k}: ${n}`).join(', ');
  return el('tr', { 'data-run-id': run.id },
    el('th', { scope: 'row' }, el('a', { href: `#/runs/${run.id}`, class: 'run-link' }, run.name),
      el('span', { class: 'muted id' }, ` #${run.id}`)),
    el('td', {}, stateBadge(run.state), run.cancel_requested && !TERMINAL.has(run.state)
      ? el('span', { class: 'muted' }, ' cancelling') : null),
    el('td', { class: 'num' }, run.current_attempt),
    el('td', { class: 'num' }, retries),
    el('td', { class: 'num', title: anomalies || 'none' }, s.anomalies_total),
    el('td', { class: 'num' }, fmt(s.best_loss)),
    el('td', { class: 'num' }, fmt(loss)),
    el('td', {}, fmtTime(run.started_at)),
    el('td', {}, fmtDuration(run.started_at, run.ended_at)));
}
