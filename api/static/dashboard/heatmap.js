// The per-layer gradient-norm profile by depth: one column per snapshot, one row per block (input at the top),
// colour = log10 of the norm. A table with the same numbers follows it for screen readers.

import { el, fmt, num } from './util.js';

// viridis, sampled: dark (small norm) → yellow (large norm)
const STOPS = ['#440154', '#482878', '#3e4989', '#31688e', '#26828e', '#1f9e89', '#35b779', '#6ece58', '#b5de2b',
  '#fde725'];

function colorAt(t) {
  if (!Number.isFinite(t)) return '#dc2626';
  const i = Math.max(0, Math.min(STOPS.length - 1, Math.round(t * (STOPS.length - 1))));
  return STOPS[i];
}

/** `snapshots` = the API's LayerSnapshot list. Returns an element (or a note when there is nothing). */
export function layerHeatmap(snapshots) {
  const usable = snapshots.filter((s) => s.block_grad_norms.length);
  if (!usable.length) {
    return el('p', { class: 'muted', id: 'layers-empty' },
      'No per-layer statistics yet (measured every telemetry.layer_stats_every steps).');
  }
  const depth = Math.max(...usable.map((s) => s.block_grad_norms.length));
  const logs = usable.flatMap((s) => s.block_grad_norms.map((v) => num(v))
    .filter((v) => Number.isFinite(v) && v > 0).map(Math.log10));
  const lo = logs.length ? Math.min(...logs) : 0;
  const hi = logs.length ? Math.max(...logs) : 1;
  const scale = (v) => {
    const n = num(v);
    if (!Number.isFinite(n)) return NaN;
    if (n <= 0) return 0;
    return hi > lo ? (Math.log10(n) - lo) / (hi - lo) : 0.5;
  };

  const cellW = 92;
  const cellH = 26;
  const labelW = 110;
  const headH = 34;
  const canvas = el('canvas', {
    id: 'layers-canvas', role: 'img',
    'aria-label': `Gradient norm by block depth for ${usable.length} snapshot(s); the table below has the numbers`,
  });
  const dpr = devicePixelRatio || 1;
  const w = labelW + usable.length * cellW;
  const h = headH + depth * cellH + 4;
  canvas.width = w * dpr;
  canvas.height = h * dpr;
  canvas.style.width = `${w}px`;
  canvas.style.height = `${h}px`;
  const ctx = canvas.getContext('2d');
  ctx.scale(dpr, dpr);
  ctx.font = '12px system-ui, sans-serif';
  ctx.textBaseline = 'middle';
  ctx.fillStyle = '#334155';
  usable.forEach((s, j) => {
    ctx.textAlign = 'center';
    ctx.fillText(`attempt ${s.attempt}`, labelW + j * cellW + cellW / 2, 10);
    ctx.fillText(`step ${s.step}`, labelW + j * cellW + cellW / 2, 25);
  });
  for (let d = 0; d < depth; d++) {
    ctx.textAlign = 'right';
    ctx.fillStyle = '#334155';
    const name = d === 0 ? 'block 0 (input)' : d === depth - 1 ? `block ${d} (output)` : `block ${d}`;
    ctx.fillText(name, labelW - 8, headH + d * cellH + cellH / 2);
    usable.forEach((s, j) => {
      const v = s.block_grad_norms[d];
      const t = scale(v);
      ctx.fillStyle = v === undefined || v === null ? '#e2e8f0' : colorAt(t);
      ctx.fillRect(labelW + j * cellW + 1, headH + d * cellH + 1, cellW - 2, cellH - 2);
      ctx.fillStyle = t > 0.6 ? '#111' : '#fff';
      ctx.textAlign = 'center';
      ctx.fillText(fmt(v, 3), labelW + j * cellW + cellW / 2, headH + d * cellH + cellH / 2);
    });
  }

  const table = el('table', { class: 'sr-only' },
    el('caption', {}, 'Gradient norm by block'),
    el('thead', {}, el('tr', {}, el('th', { scope: 'col' }, 'block'),
      usable.map((s) => el('th', { scope: 'col' }, `attempt ${s.attempt}, step ${s.step}`)))),
    el('tbody', {}, Array.from({ length: depth }, (_, d) => el('tr', {}, el('th', { scope: 'row' }, d),
      usable.map((s) => el('td', {}, fmt(s.block_grad_norms[d])))))));
  const diagnoses = usable.map((s) => el('li', {},
    `attempt ${s.attempt} (step ${s.step}): ${s.diagnosis || 'no depth problem found'}; `
    + `largest update/weight ratio ${fmt(s.update_ratio)}`));
  return el('div', { class: 'heatmap', 'data-snapshots': usable.length, 'data-depth': depth },
    el('div', { class: 'scroll-x' }, canvas),
    el('p', { class: 'muted small' }, `Colour: log10 of the block's gradient norm, from ${fmt(10 ** lo, 2)} (dark) `
      + `to ${fmt(10 ** hi, 2)} (yellow).`),
    table, el('ul', { class: 'diagnoses' }, diagnoses));
}
