#!/usr/bin/env bash
# vLLM as the EAGLE-3 hidden-state extraction server (pipeline config `hidden_states.backend: vllm`) on a GPU host.
# Runs where vLLM is installed (its image or virtualenv), never in the pipeline's environment.
#
#   MODEL=/models/Kimi-K2.5 SHARED_PATH=/shared/hidden-states infra/vllm-gpu/serve-extraction.sh [extra vllm flags]
#
# MODEL         local checkpoint folder (the pipeline reads its config.json and final-norm weight at the same path)
# SHARED_PATH   folder the server writes one safetensors file per request to; the pipeline must see it too
#               (hidden_states.shared_path when mounted elsewhere) on a filesystem with working flock
# NUM_LAYERS    decoder layers; read from MODEL/config.json (text_config for multimodal checkpoints) when unset
# TP, PORT, DTYPE (= hidden_states.dtype), MAX_MODEL_LEN (> sequences.max_seq_len)
set -euo pipefail

MODEL=${MODEL:-/models/Kimi-K2.5}
SHARED_PATH=${SHARED_PATH:-/shared/hidden-states}
TP=${TP:-8}
PORT=${PORT:-8100}
DTYPE=${DTYPE:-bfloat16}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-32769}

if [[ -z "${NUM_LAYERS:-}" ]]; then
  if [[ ! -f "$MODEL/config.json" ]]; then
    echo "set NUM_LAYERS, or MODEL to a local checkpoint folder with a config.json" >&2
    exit 2
  fi
  NUM_LAYERS=$(python3 -c 'import json, sys
config = json.load(open(sys.argv[1]))
print((config.get("text_config") or config)["num_hidden_layers"])' "$MODEL/config.json")
fi

# EAGLE-3's aux layers [2, N//2, N-3] plus N, in vLLM's "input to layer i" convention (= transformers'
# hidden_states[i]); N is the last layer's output BEFORE the final norm, which the pipeline applies.
# Kimi-K2.5 (61 layers): [2, 30, 58, 61]. Must equal hidden_states.aux_layers (default) + [N].
LAYER_IDS=${LAYER_IDS:-"[2, $((NUM_LAYERS / 2)), $((NUM_LAYERS - 3)), $NUM_LAYERS]"}

SPECULATIVE_CONFIG='{"method": "extract_hidden_states", "num_speculative_tokens": 1,
  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": '"$LAYER_IDS"'}}}'
KV_TRANSFER_CONFIG='{"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
  "kv_connector_extra_config": {"shared_storage_path": "'"$SHARED_PATH"'"}}'

mkdir -p "$SHARED_PATH"
echo "extraction server: $MODEL, layers $LAYER_IDS, files under $SHARED_PATH, port $PORT" >&2

# Prefix caching and chunked prefill off: either gives a request the states of only part of its prompt.
# Without chunked prefill one step must hold a whole prompt: max-num-batched-tokens >= max-model-len.
# No pipeline parallelism: the aux states of DeepSeek-V3-style models (Kimi) are not passed between PP stages.
exec vllm serve "$MODEL" \
  --tensor-parallel-size "$TP" \
  --trust-remote-code \
  --dtype "$DTYPE" \
  --max-model-len "$MAX_MODEL_LEN" \
  --max-num-batched-tokens "$MAX_MODEL_LEN" \
  --no-enable-prefix-caching \
  --no-enable-chunked-prefill \
  --speculative-config "$SPECULATIVE_CONFIG" \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" \
  --port "$PORT" \
  "$@"
