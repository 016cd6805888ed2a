// The per-layer gradient-norm profile by depth over time: one heat map per attempt, x = step (the same scale for
// every attempt, so a retry lines up under the steps it re-ran), y = block by depth (input at the top), colour =
// log10 of the block's gradient norm on one scale for the whole run. Below each: the diagnosis of its snapshots
// and the depth anomalies the detectors raised. A table with the newest numbers follows for screen readers.

import { el, fmt, num } from './util.js';

// viridis, sampled: dark (small norm) → yellow (large norm)
const STOPS = ['#440154', '#482878', '#3e4989', '#31688e', '#26828e', '#1f9e89', '#35b779', '#6ece58', '#b5de2b',
  '#fde725'];
const NONFINITE = '#dc2626';
const MISSING = '#e2e8f0';
const DEPTH_KINDS = new Set(['vanishing_gradients', 'vanishing']);
const LABEL_W = 96;
const AXIS_H = 22;
const HEAD_H = 18;

function colorAt(t) {
  if (!Number.isFinite(t)) return NONFINITE;
  return STOPS[Math.max(0, Math.min(STOPS.length - 1, Math.round(t * (STOPS.length - 1))))];
}

function niceTicks(lo, hi, n = 5) {
  const span = Math.max(1, hi - lo);
  const raw = span / n;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) out.push(v);
  return out;
}

/** Consecutive snapshots with the same diagnosis → "vanishing with depth at steps 40–60 (3 of 7 snapshots)". */
function diagnosisLines(snaps) {
  const runs = [];
  for (const s of snaps) {
    const last = runs[runs.length - 1];
    if (last && last.text === s.diagnosis) { last.to = s.step; last.n += 1; } else {
      runs.push({ text: s.diagnosis, from: s.step, to: s.step, n: 1 });
    }
  }
  return runs.filter((r) => r.text).map((r) => `${r.text} at step${r.from === r.to ? ` ${r.from}`
    : `s ${r.from}–${r.to}`} (${r.n} of ${snaps.length} snapshots)`);
}

/**
 * `snapshots`: the API's LayerSnapshot list; `attempts`: AttemptRead list (resume and onset steps are marked);
 * `anomalies`: AnomalyRead list (the depth findings are listed). `width`: the drawing's width in CSS pixels.
 */
export function layerHeatmap(snapshots, { attempts = [], anomalies = [], width = 560 } = {}) {
  const usable = snapshots.filter((s) => s.block_grad_norms.length);
  if (!usable.length) {
    return el('p', { class: 'muted', id: 'layers-empty' },
      'No per-layer statistics yet (measured every telemetry.layer_stats_every steps).');
  }
  const byAttempt = new Map();
  for (const s of usable) {
    if (!byAttempt.has(s.attempt)) byAttempt.set(s.attempt, []);
    byAttempt.get(s.attempt).push(s);
  }
  for (const list of byAttempt.values()) list.sort((a, b) => a.step - b.step);
  const depth = Math.max(...usable.map((s) => s.block_grad_norms.length));
  const logs = usable.flatMap((s) => s.block_grad_norms.map(num).filter((v) => Number.isFinite(v) && v > 0)
    .map(Math.log10));
  const lo = logs.length ? Math.min(...logs) : 0;
  const hi = logs.length ? Math.max(...logs) : 1;
  const scale = (v) => {
    const n = num(v);
    if (!Number.isFinite(n)) return NaN;
    return n <= 0 ? 0 : hi > lo ? (Math.log10(n) - lo) / (hi - lo) : 0.5;
  };
  const steps = usable.map((s) => s.step).sort((a, b) => a - b);
  const gaps = steps.slice(1).map((s, i) => s - steps[i]).filter((g) => g > 0).sort((a, b) => a - b);
  const gap = gaps.length ? gaps[Math.floor(gaps.length / 2)] : 1;
  const xMax = steps[steps.length - 1] + gap;
  const plotW = Math.max(120, width - LABEL_W - 24);
  const x = (step) => LABEL_W + (step / xMax) * plotW;
  const rowH = Math.max(4, Math.min(20, Math.floor(180 / depth)));
  const drawn = { depth, lo, hi, attempts: {} };

  const panels = [...byAttempt.entries()].sort((a, b) => a[0] - b[0]).map(([number, snaps]) => {
    const att = attempts.find((a) => a.number === number);
    const h = HEAD_H + depth * rowH + AXIS_H;
    const canvas = el('canvas', {
      class: 'heat', 'data-attempt': number, role: 'img',
      'aria-label': `Attempt ${number}: gradient norm by block depth over ${snaps.length} snapshot(s), steps `
        + `${snaps[0].step}–${snaps[snaps.length - 1].step}`,
    });
    const dpr = devicePixelRatio || 1;
    canvas.width = Math.round((LABEL_W + plotW + 24) * dpr);
    canvas.height = Math.round(h * dpr);
    canvas.style.width = `${LABEL_W + plotW + 24}px`;
    canvas.style.height = `${h}px`;
    const ctx = canvas.getContext('2d');
    ctx.scale(dpr, dpr);
    ctx.font = '11px system-ui, sans-serif';
    ctx.textBaseline = 'middle';
    ctx.fillStyle = '#334155';
    ctx.textAlign = 'left';
    ctx.fillText(`attempt ${number}`, 0, HEAD_H / 2);
    let cells = 0;
    const end = Number.isInteger(att?.last_step) ? att.last_step + 1 : Infinity;  // the attempt stopped there
    snaps.forEach((s, i) => {
      const x0 = x(s.step);
      const x1 = i + 1 < snaps.length ? x(snaps[i + 1].step) : x(Math.max(s.step + 1, Math.min(s.step + gap, end)));
      for (let d = 0; d < depth; d++) {
        const v = s.block_grad_norms[d];
        ctx.fillStyle = v === undefined || v === null ? MISSING : colorAt(scale(v));
        ctx.fillRect(x0, HEAD_H + d * rowH, Math.max(1, x1 - x0), rowH);
        cells += 1;
      }
    });
    ctx.fillStyle = '#334155';
    ctx.textAlign = 'right';
    ctx.fillText('input', LABEL_W - 6, HEAD_H + rowH / 2);
    if (depth > 1) ctx.fillText(`output (${depth - 1})`, LABEL_W - 6, HEAD_H + (depth - 0.5) * rowH);
    const bottom = HEAD_H + depth * rowH;
    ctx.textAlign = 'center';
    for (const t of niceTicks(0, xMax)) {
      ctx.fillRect(x(t), bottom, 1, 4);
      ctx.fillText(String(t), x(t), bottom + 12);
    }
    const marks = [];
    if (att && number > 1) marks.push({ step: att.resume_step, color: '#0f172a', what: 'resumed' });
    if (att && Number.isInteger(att.onset_step)) marks.push({ step: att.onset_step, color: NONFINITE, what: 'onset' });
    ctx.setLineDash([4, 3]);
    for (const m of marks) {
      ctx.strokeStyle = m.color;
      ctx.beginPath();
      ctx.moveTo(x(m.step) + 0.5, HEAD_H - 4);
      ctx.lineTo(x(m.step) + 0.5, bottom);
      ctx.stroke();
    }
    canvas.addEventListener('mousemove', (ev) => {
      const r = canvas.getBoundingClientRect();
      const px = ev.clientX - r.left;
      const d = Math.floor((ev.clientY - r.top - HEAD_H) / rowH);
      const s = [...snaps].reverse().find((q) => x(q.step) <= px);
      canvas.title = s && d >= 0 && d < depth
        ? `attempt ${number}, step ${s.step}, block ${d}: ${fmt(s.block_grad_norms[d])}` : '';
    });
    drawn.attempts[number] = {
      snapshots: snaps.length, cells, first_step: snaps[0].step, last_step: snaps[snaps.length - 1].step,
      marks: marks.map((m) => ({ what: m.what, step: m.step })),
    };
    const found = anomalies.filter((a) => a.attempt === number && DEPTH_KINDS.has(a.kind)).map((a) => `${a.kind} `
      + `at step ${a.step}${a.value !== null ? ` (value ${fmt(a.value)} vs threshold ${fmt(a.threshold)})` : ''}`);
    const lines = [...diagnosisLines(snaps), ...found];
    const newest = snaps[snaps.length - 1];
    return el('figure', { class: 'heat-panel', 'data-attempt': number },
      el('div', { class: 'scroll-x' }, canvas),
      el('figcaption', { class: 'small' },
        el('ul', { class: 'diagnoses', 'data-attempt': number },
          (lines.length ? lines : ['no depth problem found']).map((t) => el('li', {}, t)),
          el('li', { class: 'muted' }, `newest (step ${newest.step}): largest update/weight ratio `
            + `${fmt(newest.update_ratio)}`))));
  });

  const legend = el('p', { class: 'muted small heat-legend' },
    el('span', { class: 'ramp', 'aria-hidden': 'true', style: `background:linear-gradient(90deg,${STOPS.join(',')})` }),
    ` log10 of the block's gradient norm, ${fmt(10 ** lo, 2)} (dark) to ${fmt(10 ** hi, 2)} (yellow); red: `
    + 'not finite. Dashed: where a retry resumed (black) and the onset of a divergence (red).');
  const newest = [...byAttempt.entries()].map(([n, snaps]) => [n, snaps[snaps.length - 1]]);
  // in a div: a table will not shrink to the 1px of .sr-only, and would widen a narrow page
  const table = el('div', { class: 'sr-only' }, el('table', {},
    el('caption', {}, 'Gradient norm by block, newest snapshot of each attempt'),
    el('thead', {}, el('tr', {}, el('th', { scope: 'col' }, 'block'),
      newest.map(([n, s]) => el('th', { scope: 'col' }, `attempt ${n}, step ${s.step}`)))),
    el('tbody', {}, Array.from({ length: depth }, (_, d) => el('tr', {}, el('th', { scope: 'row' }, d),
      newest.map(([, s]) => el('td', {}, fmt(s.block_grad_norms[d]))))))));
  return el('div', {
    class: 'heatmap', 'data-snapshots': usable.length, 'data-depth': depth, 'data-drawn': JSON.stringify(drawn),
  }, legend, panels, table);
}
