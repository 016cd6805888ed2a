// A small YAML writer for showing recipes (plain data: objects, arrays, strings, numbers, booleans, null).

const PLAIN = /^[A-Za-z_][A-Za-z0-9_./-]*$/;
const RESERVED = /^(true|false|null|yes|no|on|off|~)$/i;

function scalar(v) {
  if (v === null || v === undefined) return 'null';
  if (typeof v === 'number' || typeof v === 'boolean') return String(v);
  const s = String(v);
  return PLAIN.test(s) && !RESERVED.test(s) ? s : JSON.stringify(s);
}

export function toYaml(value, indent = '') {
  if (Array.isArray(value)) {
    if (!value.length) return '[]';
    return value.map((item) => {
      if (item && typeof item === 'object' && Object.keys(item).length) {
        const inner = toYaml(item, `${indent}  `);
        return `${indent}- ${inner.slice(indent.length + 2)}`;
      }
      return `${indent}- ${toYaml(item, `${indent}  `)}`;
    }).join('\n');
  }
  if (value && typeof value === 'object') {
    const keys = Object.keys(value);
    if (!keys.length) return '{}';
    return keys.map((k) => {
      const v = value[k];
      const key = scalar(k);
      if (v && typeof v === 'object' && (Array.isArray(v) ? v.length : Object.keys(v).length)) {
        return `${indent}${key}:\n${toYaml(v, `${indent}  `)}`;
      }
      return `${indent}${key}: ${toYaml(v, `${indent}  `)}`;
    }).join('\n');
  }
  return scalar(value);
}

/** The recipe with an attempt's overrides (`{"optimizer.lr": [old, new]}`) applied: its effective recipe. */
export function applyOverrides(recipe, overrides) {
  const out = structuredClone(recipe);
  for (const [path, change] of Object.entries(overrides || {})) {
    const value = Array.isArray(change) && change.length === 2 ? change[1] : change;
    const parts = path.split('.');
    let node = out;
    for (const p of parts.slice(0, -1)) {
      if (!node[p] || typeof node[p] !== 'object') node[p] = {};
      node = node[p];
    }
    node[parts[parts.length - 1]] = value;
  }
  return out;
}
