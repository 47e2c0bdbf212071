#!/usr/bin/env bash
# Serve the default model's Q4_1 GGUF with llama-cpp-python's OpenAI server on 127.0.0.1:PORT
# (extra arguments go to `llama_cpp.server`). It runs one request at a time, takes prompts as text
# only and sends no usage in streams: bench it with `--prompt-format text --no-usage`.
#     benchmarks/peers/serve_llamacpp.sh 8002
set -euo pipefail
source "$(dirname "$0")/env.sh"
PORT=${1:?usage: serve_llamacpp.sh PORT [llama_cpp.server args]}; shift
GGUF=${GGUF:-$("$PEERS_DIR/../../.venv/bin/python" -c 'from kvstrata.model.loader import default_model_path; print(default_model_path())')}
exec "$VENVS/llamacpp/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias SmolLM2-135M-Instruct \
    --host 127.0.0.1 --port "$PORT" --n_threads "${THREADS:-2}" --n_threads_batch "${THREADS:-2}" --n_ctx 2048 "$@"
