#!/usr/bin/env python3
"""Write (and print the path of) a folder vLLM serves with `--load-format dummy` at the shape of one of
kvstrata's dummy models: the shipped config.json and SmolLM2's tokenizer and chat template, no weights.

    benchmarks/peers/dummy_model_dir.py --model llama-3.2-1b    # -> /tmp/kvstrata-peers-cache/dummy-models/llama-3.2-1b
    MODEL_DIR=$(benchmarks/peers/dummy_model_dir.py --model llama-3.2-1b) NAME=llama-3.2-1b \\
        benchmarks/peers/serve_vllm.sh 8001 --load-format dummy --dtype bfloat16

It mirrors `kvstrata serve --load-format dummy --model llama-3.2-1b`: the same config (hence the same
weight, FLOP and KV bytes per token), the same tokenizer (SmolLM2-135M's, 49,152 tokens, for every
shape), and the same stop token: kvstrata takes a dummy model's EOS from the tokenizer (the config's
ids are the real model's, in another vocabulary), so `bos_token_id`/`eos_token_id` here are the
tokenizer's (`<|im_start|>` 1, `<|im_end|>` 2); nothing else of the config changes. Stdlib only: any
python3 runs it, offline_vllm.py imports it in vLLM's venv.

A tokenizer smaller than the model's vocabulary needs nothing, found by running vLLM 0.32.0 (CPU) on the
llama-3.2-1b folder: sampled at temperature 1, 44 of 64 ids were >= 49,152 (up to 127,991). The fast
detokenizer (tokenizers' DecodeStream) turns each into "" with no error in the log; every token still
comes as its own streamed chunk (empty text), on /v1/completions and /v1/chat/completions alike, and
logprobs name it "". Prompt ids up to vocab_size - 1 are accepted (vLLM checks against the larger of
the two vocabularies). So the tokenizer is copied as it is (padding tokenizer.json with ~79k added
placeholder tokens, the fallback had it crashed, is not needed and was not tried). Traps this leaves:
- Text and tokens differ: count output tokens from `usage` (stream_options.include_usage), never from
  the text or from chunks with text (kvstrata's bench client uses usage and times every chunk).
- vLLM's own dummy weights are uniform in [-1e-3, 1e-3], not kvstrata's: the logits are almost flat, so
  greedy output repeats one token and neither engine's tokens mean anything; benchmarks use ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parent
CONFIGS = PEERS.parents[1] / "kvstrata" / "core" / "shape_configs"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def read_config(model: str) -> tuple[str, dict]:
    """A shipped shape by name, a config.json, or a folder holding one (as kvstrata's dummy_source)."""
    path = CONFIGS / f"{model}.json"
    if path.is_file():
        return model, json.loads(path.read_text())
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        sys.exit(f"{model!r} is neither a shipped shape ({shipped}) nor a config.json or a folder holding one")
    return (path.parent.name if path.name == "config.json" else path.stem), json.loads(path.read_text())


def smollm2_folder() -> Path:
    """The default model's HF folder, as kvstrata's own venv prints it (converting the GGUF once)."""
    python = PEERS.parents[1] / ".venv" / "bin" / "python"
    return Path(subprocess.run([str(python), str(PEERS / "export_hf.py")], check=True, stdout=subprocess.PIPE,
                               text=True).stdout.strip())       # its stderr (a first conversion's note) shows


def write_dir(model: str, out: str | None = None, tokenizer_dir: str | None = None) -> Path:
    """Write the folder of `model` (see --model) and return its path; rewritten on every call (3.5 MB)."""
    name, config = read_config(model)
    cache = Path(os.environ.get("PEER_CACHE", "/tmp/kvstrata-peers-cache"))
    folder = Path(out) if out else cache / "dummy-models" / name
    source = Path(tokenizer_dir) if tokenizer_dir else smollm2_folder()
    folder.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(source / f, folder / f)
    special = json.loads((folder / "tokenizer_config.json").read_text())
    ids = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    config.update(bos_token_id=ids[special["bos_token"]], eos_token_id=ids[special["eos_token"]])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a shipped shape (llama-3.2-1b, ...), a config.json or its folder")
    parser.add_argument("--out", help="the folder to write (default: $PEER_CACHE/dummy-models/<name>)")
    parser.add_argument("--tokenizer-dir", help="where SmolLM2's tokenizer files are (default: export_hf.py's folder)")
    args = parser.parse_args()
    print(write_dir(args.model, args.out, args.tokenizer_dir))


if __name__ == "__main__":
    main()
