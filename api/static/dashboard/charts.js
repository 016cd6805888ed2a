// Step charts on uPlot (vendored): one line per attempt, with the run's story drawn on top of the curves:
// attempt boundaries, anomaly markers, checkpoint markers coloured by health, and each rollback as an arrow
// from the onset back to the checkpoint the next attempt resumed from.
//
// What each chart drew is written to its element as data attributes (`data-points`: points per attempt;
// `data-drawn`: every marker with its step and pixel position), which the hover tooltips read and the browser
// tests assert on: the numbers come from the draw itself, not from the inputs.

import { actionText, el, fmt, num } from './util.js';

export const ATTEMPT_COLORS = ['#2563eb', '#d97706', '#059669', '#db2777', '#7c3aed', '#0891b2', '#65a30d'];
const ACTION_COLORS = { rollback: '#dc2626', skip_step: '#ea580c', record: '#ca8a04' };
const HEALTHY = '#16a34a';
const UNHEALTHY = '#dc2626';

export function attemptColor(n) { return ATTEMPT_COLORS[(n - 1) % ATTEMPT_COLORS.length]; }

/**
 * Build the uPlot data of one chart: a shared x (the union of steps) and one y array per (attempt, series).
 * `metrics` is the API's MetricsRead; `names` the series of this chart (e.g. ['grad_norm', 'grad_norm_clipped']).
 */
export function chartData(metrics, names, attempts) {
  const byName = new Map(metrics.series.map((s) => [s.name, s]));
  const steps = new Set();
  for (const name of names) for (const st of byName.get(name)?.steps || []) steps.add(st);
  const xs = [...steps].sort((a, b) => a - b);
  const index = new Map(xs.map((st, i) => [st, i]));
  const lines = [];
  for (const a of attempts) {
    for (const name of names) {
      const ys = new Array(xs.length).fill(null);
      const s = byName.get(name);
      let count = 0;
      if (s) {
        for (let i = 0; i < s.steps.length; i++) {
          if (s.attempts[i] !== a) continue;
          const v = num(s.values[i]);
          ys[index.get(s.steps[i])] = Number.isFinite(v) ? v : null;
          if (Number.isFinite(v)) count++;
        }
      }
      if (count) lines.push({ attempt: a, name, ys, count });
    }
  }
  return { xs, lines };
}

/**
 * A chart element: `spec = {id, title, names, labels: {name: text}, log, logToggle, note}`.
 * Returns {node, update(model), destroy()}; `model = {metrics, attempts, anomalies, checkpoints}`.
 */
export function stepChart(spec) {
  let plot = null;
  let layout = '';
  let model = null;
  let log = !!spec.log;
  let drawn = { anomalies: [], checkpoints: [], rollbacks: [], boundaries: [] };

  const body = el('div', { class: 'plot' });
  const tip = el('div', { class: 'tip', role: 'tooltip', hidden: true });
  const note = el('p', { class: 'muted chart-note' });
  const toggle = spec.logToggle
    ? el('label', { class: 'check small' },
      el('input', { type: 'checkbox', checked: log, 'data-log-toggle': spec.id,
        onchange: (ev) => { log = ev.target.checked; layout = ''; update(model); } }), ' log scale')
    : null;
  const node = el('figure', { class: 'chart', id: `chart-${spec.id}`, 'data-chart': spec.id },
    el('figcaption', {}, el('span', { class: 'chart-title' }, spec.title), toggle),
    el('div', { class: 'plot-wrap' }, body, tip), note);

  const resize = new ResizeObserver(() => {
    if (plot) plot.setSize({ width: plotWidth(), height: plot.height });
  });
  resize.observe(node);

  function plotWidth() { return Math.max(240, Math.floor(body.getBoundingClientRect().width || node.clientWidth || 480)); }

  function update(next) {
    model = next;
    if (!model) return;
    const attempts = model.attempts.map((a) => a.number);
    const { xs, lines } = chartData(model.metrics, spec.names, attempts);
    const points = {};
    for (const line of lines) {
      if (line.name === spec.names[0]) points[line.attempt] = (points[line.attempt] || 0) + line.count;
    }
    node.dataset.points = JSON.stringify(points);
    note.textContent = lines.length ? spec.note || '' : (spec.empty || 'No data yet.');
    node.classList.toggle('empty', !lines.length);
    if (!lines.length) {
      if (plot) { plot.destroy(); plot = null; layout = ''; }
      node.dataset.drawn = JSON.stringify({ anomalies: [], checkpoints: [], rollbacks: [], boundaries: [] });
      return;
    }
    const data = [xs, ...lines.map((l) => l.ys)];
    const key = JSON.stringify([lines.map((l) => `${l.attempt}:${l.name}`), log]);
    if (plot && key === layout) { plot.setData(data); return; }
    if (plot) plot.destroy();
    layout = key;
    plot = new uPlot(options(lines), data, body);
    plot.over.addEventListener('mousemove', hover);
    plot.over.addEventListener('mouseleave', () => { tip.hidden = true; });
  }

  function options(lines) {
    return {
      width: plotWidth(),
      height: 230,
      // the x range also covers the checkpoints: the final one (step N holds N completed steps) sits at N,
      // one past the last 0-based step
      scales: { x: { time: false, range: xRange }, y: log ? { distr: 3, log: 10 } : {} },
      legend: { live: true },
      cursor: { sync: { key: 'ballast-run' }, drag: { x: true, y: false } },
      series: [
        { label: 'step', value: (u, v) => (v === null || v === undefined ? '—' : String(v)) },
        ...lines.map((l, i) => ({
          label: `${spec.labels?.[l.name] || l.name} · attempt ${l.attempt}`,
          stroke: attemptColor(l.attempt),
          width: 1.5,
          dash: spec.names.indexOf(l.name) > 0 ? [5, 4] : undefined,
          spanGaps: true,
          points: { show: false },
          value: (u, v) => fmt(v),
          _line: i,
        })),
      ],
      axes: [
        { label: 'step', labelSize: 18, size: 36 },
        { size: 64, values: (u, vals) => vals.map((v) => fmt(v, 3)) },
      ],
      hooks: { draw: [drawOverlays] },
    };
  }

  function xRange(u, min, max) {
    let lo = min;
    let hi = max;
    for (const c of model.checkpoints) { lo = Math.min(lo, c.step); hi = Math.max(hi, c.step); }
    return hi > lo ? [lo, hi] : [lo - 1, hi + 1];
  }

  // ---------------------------------------------------------------------------------------- overlays
  function drawOverlays(u) {
    const ctx = u.ctx;
    const dpr = devicePixelRatio || 1;
    const { left, top, width, height } = u.bbox;
    const inX = (px) => px >= left - 0.5 && px <= left + width + 0.5;
    const xOf = (step) => u.valToPos(step, 'x', true);
    const css = (px, origin) => Math.round((px - origin) / dpr * 10) / 10; // canvas px → CSS px in the plot
    const out = { anomalies: [], checkpoints: [], rollbacks: [], boundaries: [] };
    const attempts = model.attempts;
    const byNumber = new Map(attempts.map((a) => [a.number, a]));
    ctx.save();
    ctx.textAlign = 'left';
    ctx.textBaseline = 'alphabetic';
    ctx.beginPath();
    ctx.rect(left, top, width, height);
    ctx.clip();

    // attempt boundaries: where each later attempt starts (the step it resumed at)
    for (const a of attempts) {
      if (a.number < 2) continue;
      const x = xOf(a.resume_step);
      if (!inX(x)) continue;
      ctx.strokeStyle = attemptColor(a.number);
      ctx.lineWidth = 1 * dpr;
      ctx.setLineDash([3 * dpr, 3 * dpr]);
      ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height); ctx.stroke();
      ctx.setLineDash([]);
      ctx.fillStyle = attemptColor(a.number);
      ctx.font = `${11 * dpr}px system-ui, sans-serif`;
      ctx.fillText(`attempt ${a.number}`, x + 4 * dpr, top + height - 22 * dpr);
      out.boundaries.push({ attempt: a.number, step: a.resume_step, x: css(x, left) });
    }

    // rollbacks: from the onset in the attempt that diverged back to the checkpoint the next one resumed from
    for (const a of attempts) {
      const prev = byNumber.get(a.number - 1);
      if (!prev || a.number < 2) continue;
      const from = prev.onset_step ?? prev.outcome?.onset_step ?? prev.last_step;
      if (from === null || from === undefined) continue;
      const ckpt = model.checkpoints.find((c) => c.id === a.parent_checkpoint_id);
      const to = ckpt ? ckpt.step : a.resume_step;
      const x0 = xOf(from);
      const x1 = xOf(to);
      const y = top + 16 * dpr;
      const lift = Math.min(14 * dpr, Math.abs(x0 - x1) / 3 + 4 * dpr);
      ctx.strokeStyle = UNHEALTHY;
      ctx.fillStyle = UNHEALTHY;
      ctx.lineWidth = 2 * dpr;
      ctx.beginPath();
      ctx.moveTo(x0, y + 10 * dpr);
      ctx.bezierCurveTo(x0, y - lift, x1, y - lift, x1, y + 10 * dpr);
      ctx.stroke();
      arrowHead(ctx, x1, y + 10 * dpr, dpr);
      ctx.font = `${11 * dpr}px system-ui, sans-serif`;
      const label = a.kind === 'crash_restart' ? 'restart' : 'rollback';
      ctx.fillText(`${label} ${from}→${to}`, Math.min(x0, x1) + 4 * dpr, y + 24 * dpr);
      out.rollbacks.push({ attempt: a.number, from_step: from, to_step: to, kind: a.kind,
        x0: css(x0, left), x1: css(x1, left), checkpoint_id: ckpt ? ckpt.id : null });
    }

    // checkpoints: diamonds along the bottom, green healthy / red unhealthy, hollow once deleted by retention
    for (const c of model.checkpoints) {
      const x = xOf(c.step);
      if (!inX(x)) continue;
      const y = top + height - 8 * dpr;
      ctx.fillStyle = c.healthy ? HEALTHY : UNHEALTHY;
      ctx.strokeStyle = ctx.fillStyle;
      ctx.lineWidth = 1.5 * dpr;
      diamond(ctx, x, y, 5 * dpr, !c.deleted);
      out.checkpoints.push({ id: c.id, step: c.step, attempt: c.attempt, healthy: c.healthy, deleted: c.deleted,
        x: css(x, left), y: css(y, top) });
    }

    // anomalies: triangles on the attempt's curve at the step (at the top edge when the value is off-scale)
    const primary = u.series.map((s, i) => ({ s, i })).filter(({ i }) => i > 0);
    for (const an of model.anomalies) {
      const x = xOf(an.step);
      if (!inX(x)) continue;
      let y = top + 6 * dpr;
      const idx = u.data[0].indexOf(an.step);
      const line = primary.find(({ s }) => s.label.endsWith(`attempt ${an.attempt}`));
      if (idx >= 0 && line) {
        const v = u.data[line.i][idx];
        if (v !== null && v !== undefined) {
          const py = u.valToPos(v, 'y', true);
          if (py >= top && py <= top + height) y = Math.max(py, top + 7 * dpr); // keep the mark whole
        }
      }
      const color = ACTION_COLORS[an.action] || UNHEALTHY;
      // a detector that needs several bad steps reports the onset it traced back to: draw onset → detection
      const onset = Number.isInteger(an.details?.onset_step) ? an.details.onset_step : an.step;
      const ox = xOf(onset);
      if (onset !== an.step) {
        ctx.strokeStyle = color;
        ctx.lineWidth = 2 * dpr;
        ctx.beginPath();
        ctx.moveTo(ox, y - 9 * dpr); ctx.lineTo(ox, y + 3 * dpr);
        ctx.moveTo(ox, y - 3 * dpr); ctx.lineTo(x, y - 3 * dpr);
        ctx.stroke();
      }
      ctx.fillStyle = color;
      ctx.strokeStyle = '#111';
      ctx.lineWidth = 1 * dpr;
      triangle(ctx, x, y, 6 * dpr);
      out.anomalies.push({ id: an.id, step: an.step, onset_step: onset, attempt: an.attempt, kind: an.kind,
        detector: an.detector, action: an.action, action_text: actionText(an), value: an.value,
        threshold: an.threshold,
        x: css(x, left), onset_x: css(ox, left), y: css(y, top) });
    }
    ctx.restore();
    drawn = out;
    node.dataset.drawn = JSON.stringify(out);
  }

  function hover(ev) {
    const rect = plot.over.getBoundingClientRect();
    const x = ev.clientX - rect.left;
    const y = ev.clientY - rect.top;
    const near = (m, dy = true) => Math.abs(m.x - x) <= 7 && (!dy || Math.abs(m.y - y) <= 9);
    const an = drawn.anomalies.filter((m) => near(m) || (Math.abs(m.y - y) <= 9 && x >= m.onset_x - 4 && x <= m.x));
    const ck = drawn.checkpoints.filter((m) => near(m));
    const rb = drawn.rollbacks.filter((m) => y < 40 && x >= Math.min(m.x0, m.x1) - 6 && x <= Math.max(m.x0, m.x1) + 6);
    const lines = [
      ...an.map((m) => `${m.kind} (detector ${m.detector}) · attempt ${m.attempt}, `
        + `${m.onset_step !== m.step ? `onset step ${m.onset_step}, detected at ${m.step}` : `step ${m.step}`}: `
        + `${fmt(m.value)} vs threshold ${fmt(m.threshold)} → ${m.action_text}`),
      ...ck.map((m) => `checkpoint at step ${m.step} (attempt ${m.attempt}): ${m.healthy ? 'healthy' : 'unhealthy'}`
        + `${m.deleted ? ', deleted by retention' : ''}`),
      ...rb.map((m) => `${m.kind === 'crash_restart' ? 'restart' : 'rollback'}: attempt ${m.attempt} resumed `
        + `from the step-${m.to_step} checkpoint (onset at step ${m.from_step})`),
    ];
    if (!lines.length) { tip.hidden = true; return; }
    tip.replaceChildren(...lines.map((t) => el('div', {}, t)));
    tip.hidden = false;
    const left = plot.over.offsetLeft + x + 12;
    tip.style.left = `${Math.min(left, body.clientWidth - 260)}px`;
    tip.style.top = `${plot.over.offsetTop + y + 12}px`;
  }

  return {
    node,
    update,
    destroy() { resize.disconnect(); if (plot) plot.destroy(); plot = null; },
  };
}

function arrowHead(ctx, x, y, dpr) {
  ctx.beginPath();
  ctx.moveTo(x, y + 2 * dpr);
  ctx.lineTo(x - 5 * dpr, y - 6 * dpr);
  ctx.lineTo(x + 5 * dpr, y - 6 * dpr);
  ctx.closePath();
  ctx.fill();
}

function diamond(ctx, x, y, r, filled) {
  ctx.beginPath();
  ctx.moveTo(x, y - r); ctx.lineTo(x + r, y); ctx.lineTo(x, y + r); ctx.lineTo(x - r, y);
  ctx.closePath();
  if (filled) ctx.fill();
  ctx.stroke();
}

function triangle(ctx, x, y, r) {
  ctx.beginPath();
  ctx.moveTo(x, y + r); ctx.lineTo(x - r, y - r); ctx.lineTo(x + r, y - r);
  ctx.closePath();
  ctx.fill();
  ctx.stroke();
}

/** The key under the charts: what each mark means. */
export function chartKey(attempts) {
  return el('div', { class: 'chart-key', 'aria-label': 'Chart key' },
    attempts.map((a) => el('span', {}, el('i', { class: 'swatch', style: `background:${attemptColor(a.number)}` }),
      `attempt ${a.number}`)),
    el('span', {}, el('i', { class: 'mk tri' }), 'anomaly (red: rollback, orange: skipped step, yellow: recorded)'),
    el('span', {}, el('i', { class: 'mk dia ok' }), 'healthy checkpoint'),
    el('span', {}, el('i', { class: 'mk dia bad' }), 'unhealthy checkpoint'),
    el('span', {}, el('i', { class: 'mk arrow' }), 'rollback: onset → resumed checkpoint'),
    el('span', {}, el('i', { class: 'mk dash' }), 'attempt start'),
    el('span', {}, el('i', { class: 'mk dashed-line' }), 'post-clip grad norm'));
}
