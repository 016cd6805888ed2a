// The dashboard's shell: hash routes (#/ and #/runs/<id>), the token box, and the view lifecycle.
// Each view is `mount(root, params) → unmount()`; a route change unmounts the old view (closing its streams
// and timers) before the next one mounts, so the page never reloads.

import { authRequired, getToken, setToken } from './api.js';
import { el, fill } from './util.js';
import { mountRunsPage } from './runs.js';
import { mountRunPage } from './run.js';

const routes = [
  { pattern: /^#?\/?$/, mount: (root) => mountRunsPage(root) },
  { pattern: /^#\/runs\/?$/, mount: (root) => mountRunsPage(root) },
  { pattern: /^#\/runs\/(\d+)\/?$/, mount: (root, m) => mountRunPage(root, Number(m[1])) },
];

let unmount = null;
let needsToken = false;

function render() {
  const root = document.getElementById('main');
  if (unmount) { unmount(); unmount = null; }
  for (const key of Object.keys(root.dataset)) delete root.dataset[key]; // a view's state is its own
  renderAuth();
  if (authRequired() && !getToken()) {
    fill(root, tokenPrompt());
    root.querySelector('input')?.focus();
    return;
  }
  const hash = location.hash || '#/';
  for (const route of routes) {
    const m = hash.match(route.pattern);
    if (m) { unmount = route.mount(root, m) || null; return; }
  }
  fill(root, el('section', { class: 'panel' },
    el('h1', {}, 'Not found'),
    el('p', {}, 'No page at ', el('code', {}, hash), '. ', el('a', { href: '#/' }, 'All runs'))));
}

function tokenPrompt() {
  const input = el('input', {
    id: 'token-input', type: 'password', name: 'token', autocomplete: 'off', required: true,
    placeholder: 'blst_…', 'aria-describedby': 'token-help',
  });
  const form = el('form', {
    class: 'panel token-form', id: 'token-form',
    onsubmit: (ev) => {
      ev.preventDefault();
      const value = input.value.trim();
      if (value) { needsToken = false; setToken(value); }
    },
  },
  el('h1', {}, needsToken ? 'The token was refused' : 'Sign in with an API token'),
  el('p', { id: 'token-help' },
    'This server has authentication on. Paste a token from ',
    el('code', {}, 'ballast token create --name NAME --scope read --scope submit'),
    '. It is kept in this tab only (session storage) and sent as ', el('code', {}, 'Authorization: Bearer'), '.'),
  el('label', { for: 'token-input' }, 'API token'),
  el('div', { class: 'row' }, input, el('button', { type: 'submit', class: 'primary' }, 'Use token')));
  return form;
}

function renderAuth() {
  const box = document.getElementById('auth');
  if (!authRequired()) { fill(box, el('span', { class: 'muted', title: 'The server runs with auth off' }, 'auth off')); return; }
  const token = getToken();
  if (!token) { fill(box, el('span', { class: 'muted' }, 'not signed in')); return; }
  fill(box,
    el('span', { class: 'muted', title: 'Kept in this tab’s session storage' }, `token …${token.slice(-4)}`),
    el('button', { type: 'button', class: 'link', id: 'sign-out', onclick: () => setToken(null) }, 'Forget token'));
}

window.addEventListener('hashchange', render);
window.addEventListener('ballast:token', render);
window.addEventListener('ballast:unauthorized', () => {
  if (!authRequired()) return;
  needsToken = true;
  setToken(null);
});
document.querySelector('.skip')?.addEventListener('click', (ev) => {
  ev.preventDefault();
  document.getElementById('main').focus();
});
render();
