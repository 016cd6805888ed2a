// The recipe editor: a textarea that takes a dropped or opened YAML file, validates it against the API
// (POST /recipes:validate) and submits it (POST /runs, application/yaml). Field errors are drawn next to the
// lines they name, on a layer behind the text that mirrors it line for line.

import { api, ApiError } from './api.js';
import { el, fill } from './util.js';

const PLACEHOLDER = `# Drop or paste a recipe here, for example:
apiVersion: ballast/v1
kind: StabilityRecipe
name: my-run
model: {name: tiny_gpt, n_layers: 2}
data: {name: markov}
training: {max_steps: 200}
optimizer: {name: adamw, lr: 0.003}`;

export function mountEditor(host, { onSubmitted }) {
  let errors = []; // [{path, message, line}]
  let idempotencyKey = null; // one per text: a resubmitted text never makes a second run
  let busy = false;

  const text = el('textarea', {
    id: 'recipe-text', name: 'recipe', spellcheck: 'false', wrap: 'off', rows: 16, autocapitalize: 'off',
    placeholder: PLACEHOLDER, 'aria-describedby': 'editor-help recipe-errors',
  });
  const gutter = el('div', { class: 'gutter', 'aria-hidden': 'true' });
  const marks = el('div', { class: 'marks', 'aria-hidden': 'true' });
  const file = el('input', { type: 'file', id: 'recipe-file', accept: '.yaml,.yml,.json,application/yaml,text/yaml' });
  const list = el('ul', { id: 'recipe-errors', class: 'field-errors', 'aria-live': 'polite' });
  const result = el('p', { id: 'recipe-result', class: 'muted', 'aria-live': 'polite' });
  const validateBtn = el('button', { type: 'button', id: 'validate-btn' }, 'Validate');
  const submitBtn = el('button', { type: 'submit', id: 'submit-btn', class: 'primary' }, 'Submit run');
  const zone = el('div', { class: 'editor', id: 'drop-zone' }, gutter, el('div', { class: 'code' }, marks, text));

  fill(host, el('form', { id: 'recipe-form', onsubmit: (ev) => { ev.preventDefault(); send(true); } },
    el('p', { id: 'editor-help', class: 'muted' },
      'Drop a recipe YAML file onto the editor, ', el('label', { for: 'recipe-file', class: 'file-label' }, 'open one'),
      file, ', or type it. Errors appear next to the lines they name. Ctrl+Enter submits.'),
    el('label', { for: 'recipe-text', class: 'sr-only' }, 'Recipe YAML'),
    zone, list,
    el('div', { class: 'row' }, validateBtn, submitBtn, result)));

  function lines() { return text.value.split('\n'); }

  function paint() {
    const byLine = new Map();
    for (const e of errors) if (e.line) byLine.set(e.line, [...(byLine.get(e.line) || []), e]);
    const rows = lines();
    fill(gutter, rows.map((_, i) => el('div', { class: byLine.has(i + 1) ? 'bad' : null }, i + 1)));
    fill(marks, rows.map((line, i) => {
      const here = byLine.get(i + 1);
      return el('div', { class: here ? 'bad' : null, 'data-line': here ? i + 1 : null },
        el('span', { class: 'ghost' }, line || ' '),
        here ? el('span', { class: 'msg', 'data-line': i + 1 },
          `  ← ${here.map((e) => `${e.path}: ${e.message}`).join('; ')}`) : null);
    }));
    fill(list, errors.map((e) => el('li', { 'data-line': e.line || null },
      e.line ? el('button', { type: 'button', class: 'link', onclick: () => goTo(e.line) }, `line ${e.line}`) : null,
      e.line ? ': ' : null, el('code', {}, e.path), ` ${e.message}`)));
    syncScroll();
  }

  // the textarea grows with its text (no vertical scrolling of its own), so only the horizontal offset of the
  // error layer has to follow it
  function syncScroll() {
    text.style.height = '0';
    text.style.height = `${Math.max(text.scrollHeight, 288)}px`;
    marks.scrollLeft = text.scrollLeft;
  }

  function goTo(line) {
    const rows = lines();
    const start = rows.slice(0, line - 1).reduce((n, l) => n + l.length + 1, 0);
    text.focus();
    text.setSelectionRange(start, start + (rows[line - 1] || '').length);
  }

  function setText(value) {
    text.value = value;
    idempotencyKey = null;
    errors = [];
    fill(result, '');
    paint();
  }

  async function send(submit) {
    if (busy) return;
    if (!text.value.trim()) { errors = [{ path: 'recipe', message: 'is empty', line: null }]; paint(); return; }
    busy = true;
    validateBtn.disabled = submitBtn.disabled = true;
    fill(result, submit ? 'submitting…' : 'validating…');
    try {
      if (submit) {
        idempotencyKey = idempotencyKey || crypto.randomUUID();
        const run = await api('/runs', {
          method: 'POST', body: text.value, contentType: 'application/yaml',
          headers: { 'Idempotency-Key': idempotencyKey },
        });
        errors = [];
        paint();
        fill(result, `run #${run.id} queued`);
        onSubmitted(run);
      } else {
        const out = await api('/recipes:validate', { method: 'POST', body: text.value, contentType: 'application/yaml' });
        errors = [];
        paint();
        const warn = out.warnings.length ? ` — warnings: ${out.warnings.join('; ')}` : '';
        fill(result, el('span', { class: 'ok' }, `valid: ${out.recipe.name}${warn}`));
      }
    } catch (err) {
      if (err instanceof ApiError && err.errors.length) {
        errors = err.errors;
        fill(result, el('span', { class: 'error' }, `${err.errors.length} problem${err.errors.length > 1 ? 's' : ''}`));
      } else {
        errors = [];
        fill(result, el('span', { class: 'error' },
          err instanceof ApiError ? `${err.status}: ${err.message}` : `cannot reach the server (${err.message})`));
      }
      paint();
    } finally {
      busy = false;
      validateBtn.disabled = submitBtn.disabled = false;
    }
  }

  async function readFile(f) {
    if (!f) return;
    setText(await f.text());
    fill(result, `loaded ${f.name}`);
  }

  text.addEventListener('input', () => { idempotencyKey = null; paint(); });
  text.addEventListener('scroll', syncScroll);
  text.addEventListener('keydown', (ev) => {
    if (ev.key === 'Enter' && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); send(true); }
  });
  file.addEventListener('change', () => readFile(file.files[0]));
  validateBtn.addEventListener('click', () => send(false));
  zone.addEventListener('dragover', (ev) => { ev.preventDefault(); zone.classList.add('over'); });
  zone.addEventListener('dragleave', () => zone.classList.remove('over'));
  zone.addEventListener('drop', (ev) => {
    ev.preventDefault();
    zone.classList.remove('over');
    readFile(ev.dataTransfer.files[0]);
  });
  paint();
  return () => {};
}
