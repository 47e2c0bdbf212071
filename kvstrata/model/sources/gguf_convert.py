"""Convert a GGUF file, once, into an HF-style folder kvstrata loads fast (its architecture's names and config
are the family's, kvstrata.model.arch: `GGUFLayout`).

Reading a GGUF is slow in Python (`gguf.GGUFReader` parses ~100k tokenizer fields in pure Python,
3-5 s; transformers' GGUF tokenizer path parses it again), so the result is cached:

    <cache root>/models/gguf-<sha256 of the file>-v<CONVERTER_VERSION>/
        model.safetensors   float32, HF tensor names, q/k rows back in HF order (llama), Gemma norms less their 1
        gguf-blocks         (safetensors) the file's own blocks of every matrix in a type the GGUF kernel runs,
                            rows in the same order, and every matrix's GGUF type (`--quantization gguf`)
        config.json         the family's HF config (v5 `rope_parameters`, and `rope_theta` for Llama's)
        tokenizer.json, tokenizer_config.json, chat_template.jinja   (when the GGUF has a tokenizer)
        kvstrata.json       where it came from

The folder is written under a temporary name and renamed into place, so a reader never sees a
half-written folder and two processes converting at once both end up with one complete copy.
Weights are dequantized to float32: Q4_1 / Q8_0 values are d * q + m with float16 scales, which
bfloat16 cannot hold exactly, and the loader converts to the run dtype anyway.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm
from transformers import AutoTokenizer

from kvstrata.model.arch import gguf_layout
from kvstrata.model.kernels.gguf import GGUF_TYPES

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 5          # 2: gguf-blocks; 3: Q6_K's blocks too; 4: BF16's; 5: Q5_0, Q5_1, Q4_K, Q5_K's
BLOCKS_FILE = "gguf-blocks"    # the file's own blocks of every matrix in a type the GGUF kernel runs

_QUANT_SUFFIX = re.compile(r"[.-](?:[a-z]?q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def model_name(path: Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
    return _QUANT_SUFFIX.sub("", path.stem)


def converted_dir(cache_root: Path, sha256: str) -> Path:
    return cache_root / "models" / f"gguf-{sha256}-v{CONVERTER_VERSION}"


def ensure_converted(path: Path, cache_root: Path, sha256: str) -> Path:
    """The converted folder for the GGUF at `path` (whose content hash is `sha256`); converts on a miss."""
    final = converted_dir(cache_root, sha256)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        _convert(path, tmp, sha256)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            logger.info("another process converted %s first; using its copy", path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s into %s in %.1fs (done once per file)", path.name, final,
                time.perf_counter() - start)
    return final


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves the two RoPE halves of each head, for the families
    whose layout says so)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_rows(rows: np.ndarray, rope_heads: int | None) -> np.ndarray:
    """A tensor's rows in HF order: q and k (`rope_heads` given) unpermuted, the rest as they are."""
    return np.ascontiguousarray(rows if rope_heads is None else unpermute_rope_rows(rows, rope_heads))


def _convert(path: Path, out: Path, sha256: str) -> None:
    logger.warning("converting %s once into %s (later starts skip this)", path.name, out.parent)
    # A bar on a terminal (stderr), for every entry point: serve, generate, LLM(...). Steps: reading
    # the file, one per tensor (the total is known once it is read), saving, the tokenizer.
    with tqdm(total=3, desc=f"converting {path.name}", unit="step", disable=None) as bar:
        if _convert_weights(path, out, bar):
            _save_tokenizer(path, out)
        else:
            logger.warning("%s has no tokenizer; the model will take token ids only", path.name)
        bar.update()
    (out / "kvstrata.json").write_text(json.dumps(
        {"source": str(path), "sha256": sha256, "converter_version": CONVERTER_VERSION}, indent=2))
    for f in out.iterdir():             # mkdtemp and save_file leave owner-only modes
        f.chmod(0o644)
    out.chmod(0o755)


def _convert_weights(path: Path, out: Path, bar: tqdm) -> bool:
    """Write model.safetensors and config.json; returns whether the file carries a tokenizer."""
    reader = gguf.GGUFReader(path)
    bar.total += len(reader.tensors)
    bar.update()

    def meta(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    layout = gguf_layout(meta("general.architecture"), path.name)
    config = layout.config(meta, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors})
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors, blocks, types = {}, {}, {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":               # Llama 3 scaling: llama.cpp's factor per frequency
            factors = [float(f) for f in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
            config["rope_parameters"] = {"rope_type": "freq_factors", "rope_theta": config["rope_theta"],
                                         "factors": factors}
            config["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors}
            bar.update()
            continue
        name = layout.hf_name(t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if layout.norm_shift and name.endswith("norm.weight"):     # Gemma's stored 1 + w, as transformers reads it
            w = w - np.float32(layout.norm_shift)
        rope_heads = None if not layout.permuted_rope else heads if ".q_proj." in name else \
            kv_heads if ".k_proj." in name else None
        tensors[name] = _hf_rows(w, rope_heads)
        if w.ndim == 2:
            types[name] = t.tensor_type.name
            if t.tensor_type.name in GGUF_TYPES:         # a row of blocks is a row of weights
                blocks[name] = _hf_rows(t.data, rope_heads)
        bar.update()
    save_file(blocks, str(out / BLOCKS_FILE), metadata={"types": json.dumps(types)})
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    bar.update()
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return "tokenizer.ggml.model" in reader.fields


def _save_tokenizer(path: Path, out: Path) -> None:
    """Tokenizer and chat template through transformers' own GGUF conversion (once; ~5-8 s)."""
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"transformers cannot build the tokenizer of {path.name}: {e}") from e
    tokenizer.save_pretrained(out)
    logger.info("converted the GGUF tokenizer in %.1fs", time.perf_counter() - start)
