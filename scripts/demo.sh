#!/usr/bin/env bash
# The README's main job, end to end on the embedded defaults (a SQLite file and a local Ray, both under
# $BALLAST_HOME): start the service, submit an unstable example recipe, watch it diverge, roll back to a healthy
# checkpoint and finish (with the settings the retry's replay and LR probe decided), print what the store recorded,
# stop the service.
#
# Exit status 0 only if the run SUCCEEDED after at least 2 attempts. `make demo` sets up the venv first.
# Usage: scripts/demo.sh [RECIPE]   (default: recipes/unstable-grad-spike.yaml)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v ballast >/dev/null 2>&1 || PATH="$PWD/.venv/bin:$PATH"
PY=$(command -v python3 || command -v python)
[ -x .venv/bin/python ] && PY=.venv/bin/python

RECIPE=${1:-recipes/unstable-grad-spike.yaml}
PORT=${BALLAST_DEMO_PORT:-8421}
export BALLAST_HOME=${BALLAST_DEMO_HOME:-.ballast/demo}
export BALLAST_URL="http://127.0.0.1:${PORT}"
# the embedded defaults, whatever this shell has configured
unset BALLAST_DATABASE_URL BALLAST_CHECKPOINT_ROOT BALLAST_RAY_ADDRESS RAY_ADDRESS BALLAST_AUTH_MODE BALLAST_TOKEN
rm -rf "$BALLAST_HOME"
mkdir -p "$BALLAST_HOME"
LOG="$BALLAST_HOME/serve.log"

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "starting the service: ballast serve --port $PORT (SQLite + local Ray under $BALLAST_HOME; log: $LOG)"
ballast serve --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
stop_server() {
  if kill -0 "$SERVER" 2>/dev/null; then
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER" 2>/dev/null || true
  fi
  wait "$SERVER" 2>/dev/null || true
}
trap stop_server EXIT

for i in $(seq 180); do
  if ballast runs list >/dev/null 2>&1; then break; fi
  if ! kill -0 "$SERVER" 2>/dev/null; then echo "the service exited; its log:" >&2; tail -40 "$LOG" >&2; exit 1; fi
  [ "$i" = 180 ] && { echo "the service did not come up in 180 s; its log:" >&2; tail -40 "$LOG" >&2; exit 1; }
  sleep 1
done

say "submitting $RECIPE"
grep '^#' "$RECIPE" | sed 's/^# \{0,1\}/   /' || true
RUN_ID=$(ballast submit "$RECIPE" --json | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["id"])')
echo "run $RUN_ID submitted"

say "watching run $RUN_ID (the scheduler streams the workers' events into the store)"
ballast runs watch "$RUN_ID" || true

say "what the store recorded: attempts, the decision and its reason"
ballast runs show "$RUN_ID"
say "anomalies"
ballast anomalies "$RUN_ID" || true

SHOW=$(ballast runs show "$RUN_ID" --json)
say "stopping the service"
stop_server
trap - EXIT

"$PY" - "$SHOW" <<'PY'
import json, sys
run = json.loads(sys.argv[1])
attempts = run.get("attempts") or []
ok = run["state"] == "succeeded" and len(attempts) >= 2
print(f"{'OK' if ok else 'NOT OK'}: run {run['id']} {run['state']} after {len(attempts)} attempt(s)")
for a in attempts[1:]:
    print(f"  attempt {a['number']} ({a['kind']}): {a.get('reason')}")
sys.exit(0 if ok else 1)
PY
