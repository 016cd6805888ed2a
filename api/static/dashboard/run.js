// The run page: curves per attempt with anomalies, checkpoints and rollbacks drawn on them, the attempt
// timeline, the per-layer profile over time, the recipe (as submitted and as each attempt ran it), and the actions
// (cancel, retry, export the model). While the run is active it follows the event stream and refreshes in place;
// the layer snapshots are fetched once and then only what is new (`attempt` + `after_step`).

import { api, ApiError, followEvents } from './api.js';
import { chartKey, stepChart } from './charts.js';
import { exportForm } from './export.js';
import { layerHeatmap } from './heatmap.js';
import { applyOverrides, toYaml } from './yaml.js';
import {
  actionText, download, el, fill, fmt, fmtDuration, fmtTime, overrideLines, stateBadge, TERMINAL, throttle,
} from './util.js';

const CHARTS = [
  // eval_loss (with training.eval_interval) is sparse: its points are joined across the steps in between
  { id: 'loss', title: 'Loss (solid: training, dashed: held-out eval)', names: ['loss', 'eval_loss'],
    labels: { loss: 'loss', eval_loss: 'eval' }, log: true, logToggle: true },
  { id: 'grad_norm', title: 'Global gradient norm (solid: pre-clip, dashed: post-clip)',
    names: ['grad_norm', 'grad_norm_clipped'], labels: { grad_norm: 'pre-clip', grad_norm_clipped: 'post-clip' },
    log: true, logToggle: true },
  { id: 'lr', title: 'Learning rate', names: ['lr'], labels: { lr: 'lr' } },
  { id: 'loss_scale', title: 'Loss scale', names: ['loss_scale'], labels: { loss_scale: 'scale' }, logToggle: true,
    log: true, empty: 'No loss scale: this run does not use fp16 loss scaling.' },
];

async function allPages(path, params, signal) {
  const out = [];
  let cursor = null;
  for (let page = 0; page < 50; page++) {
    const q = new URLSearchParams({ limit: '1000', ...params });
    if (cursor) q.set('cursor', cursor);
    const res = await api(`${path}?${q}`, { signal });
    out.push(...res.data);
    cursor = res.next;
    if (!cursor) break;
  }
  return out;
}

/** The run's layer snapshots, kept between refreshes: an attempt that had ended when it was last read is done;
 * the others are asked only for the steps after the newest one held. */
class LayerCache {
  constructor(id) { this.id = id; this.byAttempt = new Map(); this.done = new Set(); this.loaded = false; }

  async update(attempts, signal) {
    const path = `/runs/${this.id}/layers`;
    if (!this.loaded) {
      for (const s of await allPages(path, {}, signal)) this.add(s);
      this.loaded = true;
    } else {
      for (const a of attempts.filter((x) => !this.done.has(x.number) && x.started_at)) {
        const have = this.byAttempt.get(a.number) || [];
        const after = have.length ? have[have.length - 1].step : -1;
        for (const s of await allPages(path, { attempt: a.number, after_step: after }, signal)) this.add(s);
      }
    }
    for (const a of attempts) if (a.ended_at) this.done.add(a.number);
    return [...this.byAttempt.keys()].sort((a, b) => a - b).flatMap((n) => this.byAttempt.get(n));
  }

  add(s) {
    if (!this.byAttempt.has(s.attempt)) this.byAttempt.set(s.attempt, []);
    const list = this.byAttempt.get(s.attempt);
    if (!list.length || list[list.length - 1].step < s.step) list.push(s);
  }
}

async function loadAll(id, layerCache, signal) {
  const [run, attempts, anomalies, checkpoints, metrics] = await Promise.all([
    api(`/runs/${id}`, { signal }),
    api(`/runs/${id}/attempts`, { signal }),
    allPages(`/runs/${id}/anomalies`, {}, signal),
    api(`/runs/${id}/checkpoints`, { signal }),
    api(`/runs/${id}/metrics?max_points=4000`, { signal }),
  ]);
  const layers = await layerCache.update(attempts.data, signal);
  return { run, attempts: attempts.data, anomalies, checkpoints: checkpoints.data, metrics, layers };
}

export function mountRunPage(root, id) {
  const abort = new AbortController();
  let model = null;
  let streaming = false;
  let loading = null;
  let again = false;
  const layerCache = new LayerCache(id);
  const exporter = exportForm(id);

  const head = el('section', { class: 'panel run-head', 'aria-labelledby': 'run-title' });
  const stats = el('dl', { class: 'stats', id: 'run-stats' });
  const live = el('span', { class: 'live', id: 'live-status', 'aria-live': 'polite' });
  const message = el('p', { class: 'error', id: 'run-error', role: 'alert', hidden: true });
  const charts = CHARTS.map(stepChart);
  const key = el('div', {});
  const timeline = el('ol', { class: 'timeline', id: 'timeline' });
  const layers = el('div', { id: 'layers' });
  const anomalyTable = el('div', { class: 'scroll-x', id: 'anomalies' });
  const checkpointTable = el('div', { class: 'scroll-x', id: 'checkpoints' });
  const recipe = el('div', { id: 'recipe' });
  let recipeKey = '';
  let headKey = '';

  fill(root,
    el('p', { class: 'crumbs' }, el('a', { href: '#/' }, '← All runs')),
    head, message,
    el('section', { class: 'panel', 'aria-label': 'Summary' }, stats),
    el('section', { class: 'panel', 'aria-labelledby': 'charts-h' },
      el('div', { class: 'panel-head' }, el('h2', { id: 'charts-h' }, 'Curves'), live),
      el('div', { class: 'charts' }, charts.map((c) => c.node)), key),
    el('section', { class: 'panel', 'aria-labelledby': 'layers-h' },
      el('h2', { id: 'layers-h' }, 'Gradient norm by depth over time'),
      el('p', { class: 'muted small' }, 'Every per-layer snapshot of each attempt (telemetry.layer_stats_every), '
        + 'with what the depth profile suggests.'),
      layers),
    el('div', { class: 'two' },
      el('section', { class: 'panel', 'aria-labelledby': 'timeline-h' },
        el('h2', { id: 'timeline-h' }, 'Attempts'), timeline),
      el('section', { class: 'panel', 'aria-labelledby': 'anomalies-h' },
        el('h2', { id: 'anomalies-h' }, 'Anomalies'), anomalyTable)),
    el('section', { class: 'panel', 'aria-labelledby': 'checkpoints-h' },
      el('h2', { id: 'checkpoints-h' }, 'Checkpoints'), checkpointTable),
    el('section', { class: 'panel', 'aria-labelledby': 'recipe-h' },
      el('h2', { id: 'recipe-h' }, 'Recipe'), recipe));

  async function refresh() {
    if (loading) { again = true; return loading; }
    loading = (async () => {
      try {
        model = await loadAll(id, layerCache, abort.signal);
        message.hidden = true;
        render();
        root.dataset.ready = 'true';
        root.dataset.state = model.run.state;
        root.dataset.loaded = String(Number(root.dataset.loaded || 0) + 1);
        if (!TERMINAL.has(model.run.state)) follow();
      } catch (err) {
        if (abort.signal.aborted) return;
        message.hidden = false;
        fill(message, err instanceof ApiError && err.status === 404
          ? `Run ${id} does not exist (or belongs to someone else).`
          : err instanceof ApiError ? `${err.status}: ${err.message}` : `Cannot reach the server: ${err.message}`);
      } finally {
        loading = null;
        if (again && !abort.signal.aborted) { again = false; refresh(); }
      }
    })();
    return loading;
  }
  const soon = throttle(refresh, 2500);

  function follow() {
    if (streaming) return;
    streaming = true;
    followEvents(id, {
      signal: abort.signal,
      onStatus: (s) => {
        fill(live, s === 'live' ? el('span', { class: 'dot' }) : null,
          s === 'live' ? 'live' : s === 'reconnecting' ? 'reconnecting…' : '');
        live.dataset.status = s;
      },
      onEvent: (type, data) => {
        if (type === 'metric' && data && model) showProgress(data);
        if (type === 'end') { refresh(); return; }
        if (type !== 'run') soon();
      },
    }).finally(() => { streaming = false; });
  }

  function showProgress(m) {
    const step = stats.querySelector('[data-stat="step"]');
    if (step) step.textContent = `${m.step} / ${model.run.summary.max_steps ?? '?'} (attempt ${m.attempt})`;
    const loss = stats.querySelector('[data-stat="loss"]');
    if (loss) loss.textContent = fmt(m.loss);
  }

  // ------------------------------------------------------------------------------------------- render
  function render() {
    const { run, attempts } = model;
    const hk = JSON.stringify([run.state, run.cancel_requested, run.reason]);
    if (hk !== headKey) { headKey = hk; renderHead(run); }
    renderStats(run, attempts);
    for (const c of charts) c.update(model);
    fill(key, chartKey(attempts));
    fill(timeline, attempts.map((a) => timelineItem(a, attempts)));
    fill(layers, layerHeatmap(model.layers, { attempts, anomalies: model.anomalies,
      width: layers.clientWidth || 560 }));
    exporter.update(model.checkpoints);
    fill(anomalyTable, anomaliesTable(model.anomalies));
    fill(checkpointTable, checkpointsTable(model.checkpoints));
    const rk = JSON.stringify(attempts.map((a) => [a.number, a.overrides]));
    if (rk !== recipeKey) { recipeKey = rk; fill(recipe, recipeView(run.recipe, attempts)); }
  }

  function renderHead(run) {
    const active = !TERMINAL.has(run.state);
    const canRetry = run.state === 'failed' || run.state === 'cancelled';
    const cancel = el('button', {
      type: 'button', id: 'cancel-btn', class: 'danger', disabled: !active || run.cancel_requested,
      onclick: () => act(cancelBtnConfirm),
    }, run.cancel_requested && active ? 'Cancelling…' : 'Cancel run');
    const cancelBtnConfirm = async () => {
      if (!cancel.dataset.armed) {
        cancel.dataset.armed = '1';
        cancel.textContent = 'Confirm cancel';
        return false;
      }
      await api(`/runs/${id}/cancel`, { method: 'POST' });
      return true;
    };
    const retry = el('details', { class: 'retry', id: 'retry' },
      el('summary', { 'aria-disabled': canRetry ? null : 'true' }, 'Retry…'), retryForm(canRetry));
    fill(head,
      el('div', { class: 'panel-head' },
        el('h1', { id: 'run-title' }, run.name, el('span', { class: 'muted id' }, ` #${run.id}`), ' ',
          stateBadge(run.state)),
        el('div', { class: 'actions' }, cancel, retry,
          exporter.node,
          el('button', { type: 'button', id: 'export-btn', onclick: () => download(`ballast-run-${run.id}.json`, model) },
            'Export JSON'))),
      run.reason ? el('p', { class: 'reason', id: 'run-reason' }, run.reason) : null,
      el('p', { class: 'muted small' }, `owner ${run.owner} · recipe ${run.content_hash.slice(0, 12)}`));
  }

  function retryForm(enabled) {
    const lr = el('input', { id: 'retry-lr', name: 'lr', inputmode: 'decimal', placeholder: 'e.g. 0.001', disabled: !enabled });
    const clip = el('input', { id: 'retry-clip', name: 'clip', inputmode: 'decimal', placeholder: 'e.g. 0.5', disabled: !enabled });
    const extra = el('textarea', { id: 'retry-set', rows: 3, placeholder: 'PATH=VALUE per line, e.g. training.max_steps=400',
      disabled: !enabled });
    const out = el('p', { class: 'small', 'aria-live': 'polite' });
    return el('form', {
      class: 'retry-form',
      onsubmit: async (ev) => {
        ev.preventDefault();
        const overrides = {};
        if (lr.value.trim()) overrides['optimizer.lr'] = parseValue(lr.value);
        if (clip.value.trim()) overrides['clipping.max_norm'] = parseValue(clip.value);
        for (const line of extra.value.split('\n').map((l) => l.trim()).filter(Boolean)) {
          const eq = line.indexOf('=');
          if (eq < 1) { fill(out, el('span', { class: 'error' }, `not PATH=VALUE: ${line}`)); return; }
          overrides[line.slice(0, eq).trim()] = parseValue(line.slice(eq + 1));
        }
        try {
          const res = await api(`/runs/${id}/retry`, { method: 'POST', body: { overrides } });
          fill(out, `attempt ${res.attempt.number} queued`);
          refresh();
        } catch (err) {
          const detail = err instanceof ApiError && err.errors.length
            ? err.errors.map((e) => `${e.path}: ${e.message}`).join('; ') : err.message;
          fill(out, el('span', { class: 'error' }, detail));
        }
      },
    },
    enabled ? null : el('p', { class: 'muted small' }, 'Only a failed or cancelled run can be retried.'),
    el('label', { for: 'retry-lr' }, 'learning rate'), lr,
    el('label', { for: 'retry-clip' }, 'clip max_norm'), clip,
    el('label', { for: 'retry-set' }, 'other overrides'), extra,
    el('button', { type: 'submit', class: 'primary', disabled: !enabled }, 'Retry with these overrides'), out);
  }

  async function act(fn) {
    try {
      if (await fn()) refresh();
    } catch (err) {
      message.hidden = false;
      fill(message, err instanceof ApiError ? `${err.status}: ${err.message}` : err.message);
    }
  }

  function renderStats(run, attempts) {
    const s = run.summary;
    const kinds = Object.entries(s.anomalies_by_kind).map(([k, n]) => `${k} ${n}`).join(', ');
    const cur = attempts[attempts.length - 1];
    const item = (label, value, stat) => el('div', {}, el('dt', {}, label), el('dd', { 'data-stat': stat }, value));
    fill(stats,
      item('step', s.last_step === null ? '—' : `${s.last_step} / ${s.max_steps ?? '?'}`
        + (cur ? ` (attempt ${cur.number})` : ''), 'step'),
      item('best loss', fmt(s.best_loss), 'best'),
      item('current loss', fmt(lastLoss()), 'loss'),
      item('attempts', String(attempts.length), 'attempts'),
      item('retries used', `${s.retries_used}${s.crash_restarts_used ? ` + ${s.crash_restarts_used} restarts` : ''}`,
        'retries'),
      item('anomalies', s.anomalies_total ? `${s.anomalies_total} (${kinds})` : '0', 'anomalies'),
      item('started', fmtTime(run.started_at), 'started'),
      item('duration', fmtDuration(run.started_at, run.ended_at), 'duration'));
  }

  function lastLoss() {
    const s = model.metrics.series.find((x) => x.name === 'loss');
    return s && s.values.length ? s.values[s.values.length - 1] : null;
  }

  refresh();
  return () => { abort.abort(); for (const c of charts) c.destroy(); };
}

function parseValue(raw) {
  const v = raw.trim();
  if (/^-?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$/i.test(v)) return Number(v);
  if (v === 'true' || v === 'false') return v === 'true';
  if (v === 'null') return null;
  try { return JSON.parse(v); } catch { return v; }
}

function timelineItem(a, attempts) {
  const o = a.outcome || {};
  const steps = a.last_step === null ? `from step ${a.resume_step}` : `steps ${a.resume_step}–${a.last_step}`;
  const diff = overrideLines(a.overrides);
  const prev = attempts.find((p) => p.number === a.number - 1);
  return el('li', { class: `attempt state-${a.state}`, 'data-attempt': a.number },
    el('div', { class: 'attempt-head' },
      el('span', { class: 'swatch-num', style: `border-color:var(--a${((a.number - 1) % 7) + 1})` }, a.number),
      el('strong', {}, `Attempt ${a.number}`), ' ', el('span', { class: 'muted' }, a.kind), ' ', stateBadge(a.state),
      el('span', { class: 'muted small' }, ` ${steps} · ${fmtDuration(a.started_at, a.ended_at)}`)),
    a.number > 1 && prev ? el('p', { class: 'small' },
      `Rolled back from step ${prev.onset_step ?? prev.last_step ?? '?'} (attempt ${prev.number}) to the checkpoint `
      + `at step ${a.resume_step}${a.parent_checkpoint_id ? ` (#${a.parent_checkpoint_id})` : ''}.`) : null,
    a.reason ? el('p', { class: 'reason', 'data-reason': a.number }, a.reason) : null,
    diff.length ? el('ul', { class: 'overrides', 'aria-label': `Overrides of attempt ${a.number}` },
      diff.map((d) => el('li', { title: d.path }, el('code', {}, `${d.label} ${d.before} → ${d.after}`)))) : null,
    o.onset_step !== undefined && o.onset_step !== null || o.detector || o.error
      ? el('p', { class: 'small outcome' }, [
        o.outcome ? `ended ${o.outcome}` : 'ended',
        o.onset_step !== null && o.onset_step !== undefined ? `, onset at step ${o.onset_step}` : '',
        o.final_step !== null && o.final_step !== undefined ? `, detected at step ${o.final_step}` : '',
        o.detector ? ` by ${o.detector}` : '',
        o.value !== null && o.value !== undefined ? ` (value ${fmt(o.value)})` : '',
        o.error ? `: ${o.error}` : '',
      ].join('')) : null);
}

function anomaliesTable(rows) {
  if (!rows.length) return el('p', { class: 'muted' }, 'No anomalies.');
  return el('table', { class: 'data' },
    el('thead', {}, el('tr', {}, ['Attempt', 'Step', 'Kind (detector)', 'Value', 'Threshold', 'Action']
      .map((h) => el('th', { scope: 'col' }, h)))),
    el('tbody', {}, rows.map((a) => el('tr', { 'data-anomaly-step': a.step },
      el('td', {}, a.attempt),
      el('td', { title: 'onset → detected' }, Number.isInteger(a.details?.onset_step) && a.details.onset_step !== a.step
        ? `${a.details.onset_step} → ${a.step}` : a.step),
      el('td', {}, a.kind, a.detector !== a.kind ? el('span', { class: 'muted' }, ` (${a.detector})`) : null),
      el('td', { class: 'num' }, fmt(a.value)), el('td', { class: 'num' }, fmt(a.threshold)),
      el('td', {}, el('span', { class: `action action-${a.action}` }, actionText(a)))))));
}

function checkpointsTable(rows) {
  if (!rows.length) return el('p', { class: 'muted' }, 'No checkpoints yet.');
  return el('table', { class: 'data' },
    el('thead', {}, el('tr', {}, ['Attempt', 'Step', 'Health', 'Why', 'Kept']
      .map((h) => el('th', { scope: 'col' }, h)))),
    el('tbody', {}, rows.map((c) => el('tr', { 'data-checkpoint-step': c.step },
      el('td', {}, c.attempt), el('td', {}, c.step),
      el('td', {}, el('span', { class: `badge ${c.healthy ? 'state-succeeded' : 'state-failed'}` },
        c.healthy ? 'healthy' : 'unhealthy')),
      el('td', { class: 'small' }, Object.entries(c.verdict || {})
        .map(([k, v]) => `${k}: ${typeof v === 'number' ? fmt(v) : typeof v === 'object' ? JSON.stringify(v) : v}`)
        .join(', ')),
      el('td', {}, c.deleted ? 'deleted' : 'kept')))));
}

function recipeView(recipe, attempts) {
  const changed = attempts.filter((a) => Object.keys(a.overrides || {}).length);
  return el('div', {},
    el('details', { open: true },
      el('summary', {}, 'As submitted (normalised: every default filled in)'),
      el('pre', { class: 'code-block', id: 'recipe-yaml' }, toYaml(recipe))),
    changed.map((a) => el('details', { 'data-effective': a.number },
      el('summary', {}, `Effective recipe of attempt ${a.number} (${overrideLines(a.overrides)
        .map((d) => `${d.label} ${d.before} → ${d.after}`).join(', ')})`),
      el('pre', { class: 'code-block' }, toYaml(applyOverrides(recipe, a.overrides))))));
}
