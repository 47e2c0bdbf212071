#!/usr/bin/env bash
# Serve a GGUF with llama.cpp's C++ llama-server (install_llama_server.sh builds it) on 127.0.0.1:PORT, as its
# users start it: 16 slots with continuous batching over one unified KV cache (-np 16 -kvu), prompt cache
# and host-memory prompt cache (--cache-ram, 8 GiB) at their defaults. Extra arguments go to llama-server.
#     benchmarks/peers/serve_llama_server.sh 8003                    # the default model's Q4_1 GGUF
# kvstrata's dummy weights (--load-format dummy) at a real shape: the GGUF dummy_gguf.py writes.
#     .venv/bin/python benchmarks/peers/dummy_gguf.py --model llama-3.2-1b --type q8_0 --out /tmp/l1b.q8_0.gguf
#     GGUF=/tmp/l1b.q8_0.gguf ALIAS=llama-3.2-1b benchmarks/peers/serve_llama_server.sh 8003
# Traps:
# - Without -kvu an explicit -np splits -c per slot (-np 16 -c 16384: 1,024 tokens a request, longer ones get
#   a 400 exceed_context_size_error); with it all slots share CTX tokens of KV (22.5 KiB/token for SmolLM2,
#   32 KiB for llama-3.2-1b's, in F16), allocated at start-up.
# - -c defaults to the model's own context (131,072 for llama-3.2-1b: 4 GiB of KV): CTX sets it here (16,384),
#   PARALLEL the slots (16). A request may use at most min(CTX, the model's context): 8,192 for SmolLM2.
# - A cold-cache run wants `--no-cache-prompt -cram 0` as extra arguments; both caches are on by default.
# - Usage comes in the last choice chunk of a streamed /v1/completions (no stream_options needed), but only
#   with include_usage in a separate chunk on /v1/chat/completions. Keep-alive lines on long streams: parse
#   `data:` lines only. Start-up: /health answers 503 while loading, 200 once ready.
# - Its THREADS threads wait for each other at every op: with other work on the same 2 cores, -t 2 collapses
#   (llama-3.2-1b q8_0, batch 1: 1-3 tok/s at -t 2 against 11-14 at -t 1 beside a process taking 190%).
#   Compare engines on an otherwise idle machine.
# - Streamed chunks are not tokens: bytes of an unfinished UTF-8 character are held back and sent with the
#   next token (16 tokens came as 9 chunks). Count tokens from usage.
# - Without --alias the model id is the file path (any `model` value in a request is accepted anyway).
set -euo pipefail
source "$(dirname "$0")/env.sh"
PORT=${1:?usage: serve_llama_server.sh PORT [llama-server args]}; shift
BIN="$PEERS_DIR/build/llama-server${ISA_CAP:+-$ISA_CAP}/bin/llama-server"   # ISA_CAP: as install_llama_server.sh
test -x "$BIN" || { echo "no $BIN: run benchmarks/peers/install_llama_server.sh" >&2; exit 1; }
GGUF=${GGUF:-$("$PEERS_DIR/../../.venv/bin/python" -c 'from kvstrata.model.loader import default_model_path; print(default_model_path())')}
exec "$BIN" --model "$GGUF" --alias "${ALIAS:-SmolLM2-135M-Instruct}" --host 127.0.0.1 --port "$PORT" \
    -np "${PARALLEL:-16}" -kvu -c "${CTX:-16384}" -t "${THREADS:-2}" -tb "${THREADS:-2}" "$@"
