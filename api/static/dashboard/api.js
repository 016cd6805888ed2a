// The REST API client: bearer token from session storage, problem documents as errors, and the run event
// stream read with fetch() (EventSource cannot send an Authorization header, and the API takes tokens only there).

const TOKEN_KEY = 'ballast.token';
export const API = '/api/v1';

/** Whether the server runs with auth on (the server writes it into index.html; no request needed). */
export function authRequired() {
  return document.querySelector('meta[name="ballast-auth"]')?.content === 'token';
}

export function getToken() {
  try { return sessionStorage.getItem(TOKEN_KEY); } catch { return null; }
}

export function setToken(token) {
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
  window.dispatchEvent(new CustomEvent('ballast:token'));
}

/** A failed request: `status`, and the RFC 9457 problem document (`title`, `detail`, `errors`). */
export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem || {};
  }

  get errors() { return Array.isArray(this.problem.errors) ? this.problem.errors : []; }
}

function headers(extra = {}) {
  const h = { Accept: 'application/json', ...extra };
  const token = getToken();
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

/**
 * `api('/runs', {method, body, contentType, headers, signal})` → parsed JSON. A string body is sent as is
 * (with `contentType`), anything else as JSON. Non-2xx → ApiError; 401 also fires `ballast:unauthorized`.
 */
export async function api(path, opts = {}) {
  const { method = 'GET', body, contentType, signal } = opts;
  const extra = { ...(opts.headers || {}) };
  let payload;
  if (body !== undefined) {
    payload = typeof body === 'string' ? body : JSON.stringify(body);
    extra['Content-Type'] = contentType || (typeof body === 'string' ? 'text/plain' : 'application/json');
  }
  const res = await fetch(API + path, { method, headers: headers(extra), body: payload, signal });
  if (!res.ok) {
    let problem = {};
    try { problem = await res.json(); } catch { /* not JSON: status only */ }
    if (res.status === 401) window.dispatchEvent(new CustomEvent('ballast:unauthorized'));
    throw new ApiError(res.status, problem);
  }
  return res.status === 204 ? null : res.json();
}

/**
 * `apiBlob(path)` → `{ blob, filename, headers }` for a download (the bearer token goes in the header, which a
 * plain link cannot send). Non-2xx → ApiError with the problem document, as `api`.
 */
export async function apiBlob(path, { signal } = {}) {
  const res = await fetch(API + path, { headers: headers({ Accept: 'application/octet-stream' }), signal });
  if (!res.ok) {
    let problem = {};
    try { problem = await res.json(); } catch { /* not JSON: status only */ }
    if (res.status === 401) window.dispatchEvent(new CustomEvent('ballast:unauthorized'));
    throw new ApiError(res.status, problem);
  }
  const match = /filename="?([^";]+)"?/.exec(res.headers.get('Content-Disposition') || '');
  return { blob: await res.blob(), filename: match ? match[1] : 'model', headers: res.headers };
}

/**
 * Follow `GET /runs/{id}/events` until the run ends or `signal` aborts; `onEvent(type, data)` per message.
 * Reconnects after a dropped connection with `Last-Event-ID`, waiting the server's `retry` interval. Returns
 * when the server sent `end`; `onStatus('live' | 'reconnecting' | 'closed')` tells the page what it is doing.
 */
export async function followEvents(runId, { onEvent, onStatus = () => {}, signal }) {
  let lastId = null;
  let retryMs = 2000;
  while (!signal.aborted) {
    try {
      const extra = { Accept: 'text/event-stream' };
      if (lastId) extra['Last-Event-ID'] = lastId;
      const res = await fetch(`${API}/runs/${runId}/events`, { headers: headers(extra), signal });
      if (!res.ok) {
        if (res.status === 401) window.dispatchEvent(new CustomEvent('ballast:unauthorized'));
        throw new ApiError(res.status, null);
      }
      onStatus('live');
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n?/g, '\n');
        let cut;
        while ((cut = buffer.indexOf('\n\n')) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const msg = parseBlock(block);
          if (msg.retry) retryMs = msg.retry;
          if (msg.id) lastId = msg.id;
          if (!msg.event && !msg.data) continue;
          let data = null;
          try { data = msg.data ? JSON.parse(msg.data) : null; } catch { data = msg.data; }
          onEvent(msg.event || 'message', data);
          if (msg.event === 'end') { onStatus('closed'); return; }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status >= 400 && err.status < 500) { onStatus('closed'); return; }
    }
    if (signal.aborted) return;
    onStatus('reconnecting');
    await new Promise((resolve) => {
      const t = setTimeout(resolve, retryMs);
      signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
    });
  }
}

function parseBlock(block) {
  const msg = { data: '' };
  const data = [];
  for (const line of block.split('\n')) {
    if (!line || line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') data.push(value);
    else if (field === 'event') msg.event = value;
    else if (field === 'id') msg.id = value;
    else if (field === 'retry' && /^\d+$/.test(value)) msg.retry = Number(value);
  }
  msg.data = data.join('\n');
  return msg;
}
