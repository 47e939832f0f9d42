#!/usr/bin/env bash
# The main job: a local loraplex cluster (etcd, Ray, 2 replicas + the ingress) serving the
# demo model, two demo adapters registered through the tenant API, and sample requests
# through the OpenAI-compatible API. The cluster keeps running: `.venv/bin/loraplex down`
# stops it (registered adapters are kept for the next `up`).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${LORAPLEX_STATE_DIR:-$HOME/.loraplex}
LORAPLEX=".venv/bin/loraplex"

"$LORAPLEX" up --state-dir "$STATE"
export LORAPLEX_URL=${LORAPLEX_URL:-http://127.0.0.1:8000}
export LORAPLEX_API_KEY
LORAPLEX_API_KEY=$(cat "$STATE/demo_api_key")

for adapter in sql-r8 math-r64; do
  if ! "$LORAPLEX" adapters list | grep -q "^$adapter "; then
    "$LORAPLEX" adapters add "$adapter" "$STATE/demo-assets/adapters/$adapter"
  fi
done
"$LORAPLEX" adapters list

request() {
  echo "+ POST $1  $2"
  curl -sS --fail-with-body "$LORAPLEX_URL$1" -H "Authorization: Bearer $LORAPLEX_API_KEY" \
       -H 'Content-Type: application/json' -d "$2"
  echo
}
request /v1/chat/completions '{"model": "sql-r8", "messages": [{"role": "user", "content": "List the users."}], "max_tokens": 24, "temperature": 0}'
request /v1/completions '{"model": "math-r64", "prompt": "The sum of two and two is", "max_tokens": 16, "temperature": 0}'
request /v1/completions '{"model": "loraplex-demo-llama", "prompt": "Once upon a time", "max_tokens": 12, "stream": true}'
"$LORAPLEX" status --state-dir "$STATE"
echo "the cluster keeps serving at $LORAPLEX_URL; stop it with: $LORAPLEX down"
