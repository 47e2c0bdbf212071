#!/usr/bin/env bash
# Serve the default model with vLLM's CPU build on 127.0.0.1:PORT (extra arguments go to its OpenAI server).
# vLLM cannot read the GGUF, so it serves the HF folder kvstrata's loader converts it into. It drops
# torch to one thread unless OMP_NUM_THREADS is set. Start-up takes about 2 minutes (torch.compile).
#     benchmarks/peers/serve_vllm.sh 8001 --dtype bfloat16
set -euo pipefail
source "$(dirname "$0")/env.sh"
PORT=${1:?usage: serve_vllm.sh PORT [vllm serve args]}; shift
MODEL_DIR=${MODEL_DIR:-$("$PEERS_DIR/../../.venv/bin/python" "$PEERS_DIR/export_hf.py")}
export OMP_NUM_THREADS=${THREADS:-2} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4} VLLM_CPU_OMP_THREADS_BIND=auto
# The `vllm` CLI looks up the distribution "vllm" (this one is "vllm-cpu") and fails; the module does not.
exec "$VENVS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --served-model-name SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" --max-model-len 2048 --seed 0 "$@"
