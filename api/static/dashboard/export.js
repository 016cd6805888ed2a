// "Export model…" on the run page: the weights of a checkpoint (default: the run's latest healthy one) as a
// safetensors or torch state-dict file, built and verified by the server (`GET /runs/{id}/export`).

import { ApiError, apiBlob } from './api.js';
import { el, fill } from './util.js';

/** `exportForm(runId)` → `{ node, update(checkpoints) }`; the node survives the head's re-renders. */
export function exportForm(runId) {
  const select = el('select', { id: 'export-checkpoint', name: 'checkpoint' });
  const format = el('select', { id: 'export-format', name: 'format' },
    el('option', { value: 'safetensors' }, 'safetensors (model.safetensors)'),
    el('option', { value: 'state_dict' }, 'state dict (torch.load, model.pt)'));
  const status = el('p', { class: 'small', id: 'export-status', 'aria-live': 'polite' });
  const button = el('button', { type: 'submit', class: 'primary', id: 'export-model-btn' }, 'Download weights');
  let key = '';

  const form = el('form', {
    class: 'retry-form',
    onsubmit: async (ev) => {
      ev.preventDefault();
      const q = new URLSearchParams({ format: format.value });
      if (select.value) q.set('checkpoint', select.value);
      button.disabled = true;
      fill(status, 'Exporting…');
      try {
        const { blob, filename, headers } = await apiBlob(`/runs/${runId}/export?${q}`);
        const url = URL.createObjectURL(blob);
        const a = el('a', { href: url, download: filename });
        document.body.append(a);
        a.click();
        a.remove();
        setTimeout(() => URL.revokeObjectURL(url), 1000);
        status.dataset.done = filename;
        fill(status, `${filename}: checkpoint #${headers.get('X-Ballast-Checkpoint')} (step `
          + `${headers.get('X-Ballast-Step')}), sha256 ${(headers.get('X-Ballast-Sha256') || '').slice(0, 12)}…`);
      } catch (err) {
        const detail = err instanceof ApiError && err.errors.length
          ? err.errors.map((e) => `${e.path}: ${e.message}`).join('; ') : err.message;
        fill(status, el('span', { class: 'error' }, detail));
      } finally {
        button.disabled = false;
      }
    },
  },
  el('label', { for: 'export-checkpoint' }, 'checkpoint'), select,
  el('label', { for: 'export-format' }, 'format'), format, button, status);

  function update(checkpoints) {
    const live = checkpoints.filter((c) => !c.deleted);
    const k = JSON.stringify(live.map((c) => [c.id, c.healthy]));
    if (k === key) return;
    key = k;
    const chosen = select.value;
    const healthy = live.filter((c) => c.healthy);
    fill(select,
      el('option', { value: '', disabled: !healthy.length }, healthy.length
        ? 'latest healthy (the server picks)' : 'no healthy checkpoint yet'),
      [...live].reverse().map((c) => el('option', { value: c.id },
        `#${c.id}: attempt ${c.attempt}, step ${c.step}${c.healthy ? '' : ' (unhealthy)'}`)));
    select.value = live.some((c) => String(c.id) === chosen) ? chosen : healthy.length ? '' : live.length
      ? String(live[live.length - 1].id) : '';
    button.disabled = !live.length;
  }

  return { node: el('details', { class: 'retry', id: 'export-model' }, el('summary', {}, 'Export model…'), form),
    update };
}
