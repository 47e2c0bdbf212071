#!/usr/bin/env bash
# HF transformers generate() as the offline baseline, in its own venv (never a kvstrata dependency).
set -euo pipefail
source "$(dirname "$0")/env.sh"
V="$VENVS/hf"
if test -f "$V/.installed"; then exit 0; fi
make_venv hf
nice -n 10 "$V/bin/pip" install --quiet torch==2.13.0 transformers==5.24.0 safetensors tokenizers accelerate
touch "$V/.installed"
"$V/bin/python" -c 'import torch, transformers; print("hf:", "torch", torch.__version__, "transformers", transformers.__version__)'
