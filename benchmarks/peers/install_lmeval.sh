#!/usr/bin/env bash
# lm-evaluation-harness (PyPI lm-eval) in its own venv: the `local-completions` and `local-chat-completions`
# clients (extra `api`) that benchmarks/lm_eval_check.py points at kvstrata, and the `hf` backend (extra `hf`)
# it compares them with. Never a kvstrata dependency.
#
# Traps:
# * torch goes in first, pinned, and stays pinned through a constraint file: `lm-eval[hf]` asks only
#   torch>=1.8, and anything that resolves torch afresh may pull a multi-GB CUDA build instead of the CPU
#   wheel on this machine's disk.
# * The bare package has no client and no hf backend: without the `api` extra `--model local-completions`
#   raises ModuleNotFoundError (aiohttp, tenacity); the `hf` extra brings transformers, accelerate and peft.
# * The Hugging Face hub is unreachable here: env.sh sets HF_HUB_OFFLINE=1, the check HF_DATASETS_OFFLINE=1,
#   and our tasks load local JSON files (`dataset_path: json`), the model a local folder.
# Took 107 s and makes a 1.8 GB venv: lm-eval 0.4.13, torch 2.13.0+cpu, transformers 5.24.0, datasets 5.2.0.
# * `--model hf --model_args ...,device=cpu` fails ("HFLM() got multiple values for keyword argument
#   'device'"): the device goes in lm_eval's own `--device cpu`.
# * pip prints "Location 'file:///…/simple/<name>/' is ignored" for each package the local indexes lack: noise.
set -euo pipefail
source "$(dirname "$0")/env.sh"
V="$VENVS/lmeval"
if test -f "$V/.installed"; then exit 0; fi
make_venv lmeval
nice -n 10 "$V/bin/pip" install --quiet torch==2.13.0
echo "torch==2.13.0" > "$V/constraints.txt"
nice -n 10 "$V/bin/pip" install --quiet -c "$V/constraints.txt" "lm-eval[api,hf]==0.4.13" transformers==5.24.0
touch "$V/.installed"
"$V/bin/python" -c 'import lm_eval, torch, transformers, datasets
from importlib.metadata import version
print("lmeval:", "lm-eval", version("lm-eval"), "torch", torch.__version__, "transformers", transformers.__version__,
      "datasets", datasets.__version__)'
