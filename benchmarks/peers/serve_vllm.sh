#!/usr/bin/env bash
# Serve the default model with vLLM's CPU build on 127.0.0.1:PORT (extra arguments go to its OpenAI server).
# vLLM cannot read the GGUF, so it serves the HF folder kvstrata's loader converts it into. It drops
# torch to one thread unless OMP_NUM_THREADS is set. Start-up takes about 2 minutes (torch.compile).
#     benchmarks/peers/serve_vllm.sh 8001 --dtype bfloat16
# A dummy shape (kvstrata's --load-format dummy): the folder dummy_model_dir.py writes, served under its name
# (llama-3.2-1b: ready in 162 s with a cold compile cache, on busy cores).
#     MODEL_DIR=$(benchmarks/peers/dummy_model_dir.py --model llama-3.2-1b) NAME=llama-3.2-1b \
#         benchmarks/peers/serve_vllm.sh 8001 --load-format dummy --dtype bfloat16
# VLLM_CPU_KVCACHE_SPACE is GiB of KV cache, allocated at start-up on top of the weights: 4 GiB holds 186k
# tokens of SmolLM2, 131k of llama-3.2-1b (32 KiB/token), whose bf16 weights are 2.5 GB: 9.6 GiB RSS in all
# (8.3 in the worker) on a 24 GiB machine. Lower it for the 7B/8B shapes (15-16 GB of bf16 weights).
# KV_BYTES sizes it in bytes instead (--kv-cache-memory-bytes): VLLM_CPU_KVCACHE_SPACE is then unset, since it
# overrides the flag when set (and an empty one crashes vLLM's workers).
# NAME is the model name clients send (default SmolLM2-135M-Instruct), MAX_MODEL_LEN the context (default 2048).
set -euo pipefail
source "$(dirname "$0")/env.sh"
PORT=${1:?usage: serve_vllm.sh PORT [vllm serve args]}; shift
MODEL_DIR=${MODEL_DIR:-$("$PEERS_DIR/../../.venv/bin/python" "$PEERS_DIR/export_hf.py")}
export OMP_NUM_THREADS=${THREADS:-2} VLLM_CPU_OMP_THREADS_BIND=auto
if [ -n "${KV_BYTES:-}" ]; then
    unset VLLM_CPU_KVCACHE_SPACE
    set -- --kv-cache-memory-bytes "$KV_BYTES" "$@"
else
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
fi
# The `vllm` CLI looks up the distribution "vllm" (this one is "vllm-cpu") and fails; the module does not.
exec "$VENVS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
    --served-model-name "${NAME:-SmolLM2-135M-Instruct}" \
    --host 127.0.0.1 --port "$PORT" --max-model-len "${MAX_MODEL_LEN:-2048}" --seed 0 "$@"
