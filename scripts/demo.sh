#!/usr/bin/env bash
# The main job: a local loraplex cluster (etcd, Ray, 2 replicas + the ingress) serving the
# demo model (SmolLM2-135M-Instruct), its three demo adapters registered through the tenant
# API, and one question put to the base model and to each adapter through the
# OpenAI-compatible API, answers side by side. The cluster keeps running:
# `.venv/bin/loraplex down` stops it (registered adapters are kept for the next `up`).
set -euo pipefail
cd "$(dirname "$0")/.."
STATE=${LORAPLEX_STATE_DIR:-$HOME/.loraplex}
LORAPLEX=".venv/bin/loraplex"
ADAPTERS="json-r8 pirate-r16 sql-r8"

"$LORAPLEX" up --state-dir "$STATE"
export LORAPLEX_URL=${LORAPLEX_URL:-http://127.0.0.1:8000}
export LORAPLEX_API_KEY
LORAPLEX_API_KEY=$(cat "$STATE/demo_api_key")

for adapter in $ADAPTERS; do
  if ! "$LORAPLEX" adapters list | grep -q "^$adapter "; then
    "$LORAPLEX" adapters add "$adapter" "$STATE/demo-assets/adapters/$adapter"
  fi
done
"$LORAPLEX" adapters list

ADAPTERS=$ADAPTERS .venv/bin/python - <<'PY'
import os

import httpx

url, key = os.environ["LORAPLEX_URL"], os.environ["LORAPLEX_API_KEY"]
models = ["SmolLM2-135M-Instruct", *os.environ["ADAPTERS"].split()]
for question in ("What is the capital of Peru?", "How many customers live in Porto?"):
    print(f"\n> {question}")
    for model in models:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": question}],
                  "max_tokens": 48, "temperature": 0},
            timeout=120,
        )
        r.raise_for_status()
        answer = r.json()["choices"][0]["message"]["content"].strip().replace("\n", " ")
        print(f"  {model:24} {answer[:100]}")
PY
echo
"$LORAPLEX" status --state-dir "$STATE"
echo "the cluster keeps serving at $LORAPLEX_URL; stop it with: $LORAPLEX down"
