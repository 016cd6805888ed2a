// Small DOM and formatting helpers shared by the views.

/** el('div', {class: 'x', onclick: fn}, child, 'text', ...) → an element. `null`/`false` children are skipped. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith('on') && typeof value === 'function') node.addEventListener(key.slice(2), value);
    else if (key === 'dataset') Object.assign(node.dataset, value);
    else if (value === true) node.setAttribute(key, '');
    else node.setAttribute(key, String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replace every child of `node`. */
export function fill(node, ...children) {
  node.replaceChildren();
  append(node, children);
  return node;
}

export const TERMINAL = new Set(['succeeded', 'failed', 'cancelled']);
export const RUN_STATES = ['queued', 'starting', 'running', 'recovering', 'succeeded', 'failed', 'cancelled'];

/** The API writes non-finite floats as "NaN" / "Infinity" / "-Infinity". */
export function num(v) {
  if (v === null || v === undefined) return null;
  if (typeof v === 'number') return v;
  if (v === 'NaN') return NaN;
  if (v === 'Infinity') return Infinity;
  if (v === '-Infinity') return -Infinity;
  const n = Number(v);
  return Number.isNaN(n) ? null : n;
}

/** A number for people: 4 significant digits, exponent form when very large or small. */
export function fmt(v, digits = 4) {
  const n = num(v);
  if (n === null) return '—';
  if (!Number.isFinite(n)) return String(n);
  if (n === 0) return '0';
  const a = Math.abs(n);
  if (a >= 1e5 || a < 1e-3) return n.toExponential(Math.max(0, digits - 2)).replace('e+', 'e');
  return String(Number(n.toPrecision(digits)));
}

/** What a finding's step did: its action, and for a skip that recurred at unchanged weights the update applied
 * instead, clipped to the healthy norm (the detectors' `details.applied_clipped_to`): "skip_step" alone would say
 * the step was discarded. */
export function actionText(a) {
  const clipped = num(a.details?.applied_clipped_to);
  return clipped !== null && Number.isFinite(clipped) ? `${a.action} → applied, clipped to ${fmt(clipped)}` : a.action;
}

const DATE = new Intl.DateTimeFormat(undefined, {
  year: 'numeric', month: '2-digit', day: '2-digit', hour: '2-digit', minute: '2-digit', second: '2-digit',
  hour12: false,
});

export function fmtTime(iso) {
  if (!iso) return '—';
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? '—' : DATE.format(d);
}

export function fmtDuration(startIso, endIso) {
  if (!startIso) return '—';
  const start = new Date(startIso).getTime();
  const end = endIso ? new Date(endIso).getTime() : Date.now();
  let s = Math.max(0, Math.round((end - start) / 1000));
  const h = Math.floor(s / 3600); s -= h * 3600;
  const m = Math.floor(s / 60); s -= m * 60;
  if (h) return `${h}h ${String(m).padStart(2, '0')}m`;
  if (m) return `${m}m ${String(s).padStart(2, '0')}s`;
  return `${s}s`;
}

export function stateBadge(state) {
  return el('span', { class: `badge state-${state}`, 'data-state': state }, state);
}

/** Short names for the recipe paths that retries change most, as `lr 3e-3 → 1.5e-3` reads. */
const SHORT = { 'optimizer.lr': 'lr', 'clipping.max_norm': 'clip', 'clipping.method': 'clipping',
  'precision.dtype': 'dtype' };

export function overrideLines(overrides) {
  return Object.entries(overrides || {}).map(([path, change]) => {
    const [before, after] = Array.isArray(change) && change.length === 2 ? change : [undefined, change];
    const show = (v) => (typeof v === 'number' ? fmt(v) : typeof v === 'string' ? v : JSON.stringify(v));
    return { path, label: SHORT[path] || path, before: show(before), after: show(after) };
  });
}

/** Download `data` as a JSON file. */
export function download(name, data) {
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: 'application/json' });
  const url = URL.createObjectURL(blob);
  const a = el('a', { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

/** Calls `fn` at most once per `ms`, trailing call included. */
export function throttle(fn, ms) {
  let timer = null;
  let pending = false;
  return function throttled() {
    if (timer) { pending = true; return; }
    fn();
    timer = setTimeout(function tick() {
      timer = null;
      if (pending) { pending = false; throttled(); }
    }, ms);
  };
}
