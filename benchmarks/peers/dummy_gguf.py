"""Write a GGUF of kvstrata's dummy weights, so llama.cpp serves the very weights `--load-format dummy` does.

    .venv/bin/python benchmarks/peers/dummy_gguf.py --model llama-3.2-1b --type q8_0 --out /tmp/l1b.q8_0.gguf
    GGUF=/tmp/l1b.q8_0.gguf ALIAS=llama-3.2-1b benchmarks/peers/serve_llama_server.sh 8003

`--model` is what kvstrata's `--model` takes with `--load-format dummy` (a shipped shape such as
llama-3.2-1b, qwen2.5-7b, or a config.json); `--seed` is its seed (kvstrata's is 0). Every tensor is
kvstrata.model.sources.dummy's float32 tensor, laid out as llama.cpp's convert_hf_to_gguf.py lays out an HF
checkpoint (llama.cpp commit 0c1e57098, the one install_llama_server.sh builds):
- architecture `llama` for llama/mistral configs, `qwen2` for qwen2; tensor names from gguf-py's map;
- llama's q/k rows permuted from HF's rotate-half RoPE layout to llama.cpp's interleaved one (qwen2 runs
  NEOX RoPE in llama.cpp: no permutation); llama3 RoPE scaling as the `rope_freqs.weight` tensor;
- norms, biases and rope_freqs in F32; every 2-D weight in the chosen type: bf16 (rounded as torch rounds
  kvstrata's bf16 weights: the same bits) and q8_0 as the converter writes them (token_embd included);
  q4_0 as llama-quantize makes it (the converter has no q4_0): Q4_0, but the output matrix (token_embd when
  the embeddings are tied) in Q6_K. Quantized from the float32 values; Q8_0 and Q4_0 by gguf-py, Q6_K here
  (gguf-py cannot): all three byte for byte what ggml's quantize_row_*_ref give (checked).
- tied embeddings: no output.weight (llama.cpp reuses token_embd).
Tokenizer and chat template: the default model's (SmolLM2's), as kvstrata uses them for dummy weights,
copied from its GGUF and padded to the config's vocab_size with `<|id_N|>`, the texts kvstrata's
pad_vocabulary gives those ids (llama.cpp checks the token count against token_embd's rows). They are
NORMAL tokens: llama.cpp prints their text as kvstrata does, and does not scan prompts for them, which
it would do for 70-100k USER_DEFINED ones on every text prompt (so a prompt spelling out `<|id_N|>` is
one token to kvstrata and several here; no benchmark prompt does).
Memory: one float32 tensor at a time (1 GB for llama-3.2-1b's embedding, 2 GB for the 8B's). The files
are big (1B: 2.5 GB bf16, 1.3 GB q8_0, 0.8 GB q4_0): write them to /tmp, never into the repository.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from kvstrata.model.loader import default_model_path
from kvstrata.model.sources.dummy import dummy_source, dummy_tensor, tensor_shapes

Q = gguf.GGMLQuantizationType
TYPES = {"bf16": (gguf.LlamaFileType.MOSTLY_BF16, Q.BF16),
         "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
         "q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_0)}
ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}
ROWS_PER_CHUNK = 4096                       # quantize this many rows at a time: numpy temporaries stay small


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: HF rotate-half rows -> llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(arch) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: the per-frequency divisors of llama3 RoPE scaling."""
    s, dim = arch.rope_scaling, arch.head_dim
    freqs = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q6_K_ref, byte for byte (checked against it): make_qx_quants' 19-step scale
    search per sub-block of 16, int8 scales under one fp16 scale per block of 256, 6-bit quants. Vectorized
    over sub-blocks, with ggml's float32 operations in ggml's order (its sums are sequential)."""
    f32 = np.float32
    rows = x.shape[0]
    xb = x.reshape(-1, 16, 16).astype(f32, copy=False)                # (blocks, sub-blocks, 16)
    b = xb.reshape(-1, 16).T.copy()                                   # (16, sub-blocks): rows contiguous
    vmax = b[np.abs(b).argmax(axis=0), np.arange(b.shape[1])]         # the first value of largest size
    live = np.abs(vmax) >= f32(1e-15)                                 # GROUP_MAX_EPS
    vmax = np.where(live, vmax, f32(1))
    wx = b * b * b                                                    # w*x[i] with w = x[i]^2 (rmse_type 1)
    w = b * b
    lv, t = np.empty_like(b), np.empty(b.shape[1], f32)

    def trial(nmax: np.float32) -> tuple[np.ndarray, np.ndarray]:
        np.multiply(-nmax / vmax, b, out=lv)
        np.rint(lv, out=lv)                                            # nearest_int rounds half to even
        np.clip(lv, -32, 31, out=lv)
        sumlx, suml2 = np.zeros_like(t), np.zeros_like(t)
        for i in range(16):                                            # ggml's sequential float sums
            sumlx += np.multiply(wx[i], lv[i], out=t)
            np.multiply(w[i], lv[i], out=t)
            suml2 += np.multiply(t, lv[i], out=t)
        return sumlx, suml2

    sumlx, suml2 = trial(f32(32))
    lq = lv.copy()
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, f32(1)), f32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step:
            sumlx, suml2 = trial(f32(32) + f32(0.1) * f32(step))
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            np.copyto(lq, lv, where=better)
            scale = np.where(better, sumlx / np.where(better, suml2, f32(1)), scale)
            best = np.where(better, scale * sumlx, best)
    lq, live = lq.T, live[:, None]
    lq = np.where(live, lq + 32, 0).reshape(xb.shape)                 # an all-zero sub-block keeps L = 0
    scale = np.where(live[:, 0], scale, f32(0)).reshape(-1, 16)        # (blocks, 16)
    max_scale = scale[np.arange(len(scale)), np.abs(scale).argmax(axis=1)][:, None]
    zero = np.abs(max_scale) < f32(1e-15)                             # the block is all zero bytes
    iscale = f32(-128) / np.where(zero, f32(1), max_scale)
    d16 = np.where(zero, f32(0), f32(1) / iscale).astype(np.float16)
    sc = np.where(zero, 0, np.minimum(127, np.rint(iscale * scale))).astype(np.int8)
    dsub = (d16.astype(f32) * sc.astype(f32))[..., None]             # (blocks, 16, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dsub != 0, np.clip(np.rint(xb / dsub), -32, 31) + 32, lq)
    q = np.where(zero[..., None], 0, q).astype(np.uint8).reshape(-1, 2, 4, 32)   # (blocks, half, quarter, 32)
    ql = np.concatenate([q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4,
                         q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4], axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8)], axis=1).reshape(rows, -1)


def encode(t: torch.Tensor, qtype: Q) -> np.ndarray:
    """The bytes of `t` (float32) in `qtype`, a row chunk at a time."""
    if qtype == Q.F32:
        return t.numpy().view(np.uint8)
    if qtype == Q.BF16:                                   # torch's round-to-nearest-even, as kvstrata casts
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    a = t.numpy()
    quant, n = ((quantize_q6_k, ROWS_PER_CHUNK // 16) if qtype == Q.Q6_K     # its temporaries are 16x: fit a cache
                else (lambda c: gguf.quants.quantize(c, qtype), ROWS_PER_CHUNK))
    return np.concatenate([quant(a[i:i + n]) for i in range(0, a.shape[0], n)])


def plan(source, ftype_qtype: Q, seed: int):
    """[(gguf name, shape, qtype, make)] in the converter's order: extra tensors first, then the checkpoint's."""
    arch = source.arch
    mtype = source.config["model_type"]
    tmap = gguf.get_tensor_name_map(ARCHS[mtype], arch.num_layers)
    out = []
    if arch.rope_scaling and arch.rope_scaling["rope_type"] == "llama3":
        out.append(("rope_freqs.weight", (arch.head_dim // 2,), Q.F32, lambda: llama3_rope_factors(arch)))
    for hf, shape in tensor_shapes(arch).items():
        name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf}")
        if len(shape) <= 1 or name.endswith("_norm.weight"):
            qtype = Q.F32
        elif ftype_qtype == Q.Q4_0 and (name == "output.weight"
                                        or (arch.tie_word_embeddings and name == "token_embd.weight")):
            qtype = Q.Q6_K if shape[-1] % 256 == 0 else Q.Q8_0          # llama-quantize's rule
        else:
            qtype = ftype_qtype
        if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16                                               # the converter's fallback
        n_head = None
        if ARCHS[mtype] == gguf.MODEL_ARCH.LLAMA and ".self_attn.q_proj." in hf:
            n_head = arch.num_heads
        elif ARCHS[mtype] == gguf.MODEL_ARCH.LLAMA and ".self_attn.k_proj." in hf:
            n_head = arch.num_kv_heads

        def make(hf=hf, shape=shape, n_head=n_head):
            t = dummy_tensor(hf, shape, seed)
            return permute(t, n_head) if n_head else t
        out.append((name, shape, qtype, make))
    return out


def add_metadata(w: gguf.GGUFWriter, source, ftype, seed: int) -> None:
    """The keys TextModel/LlamaModel/Qwen2Model.set_gguf_parameters write, then SmolLM2's tokenizer."""
    arch, config = source.arch, source.config
    is_llama = ARCHS[config["model_type"]] == gguf.MODEL_ARCH.LLAMA
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{source.name} (kvstrata dummy weights, seed {seed})")
    w.add_block_count(arch.num_layers)
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    if arch.rope_scaling and arch.rope_scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(arch.rope_scaling["factor"])
    w.add_rope_freq_base(arch.rope_theta)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    if config.get("head_dim"):
        w.add_key_length(arch.head_dim)
        w.add_value_length(arch.head_dim)
    w.add_file_type(ftype)
    if is_llama:
        w.add_vocab_size(arch.vocab_size)
        w.add_rope_dimension_count(arch.head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    reader = gguf.GGUFReader(default_model_path())
    n_tok = len(reader.fields["tokenizer.ggml.tokens"].contents())
    if arch.vocab_size < n_tok:
        raise ValueError(f"vocab_size {arch.vocab_size} is below the tokenizer's {n_tok} tokens")
    pad = range(n_tok, arch.vocab_size)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<|id_{i}|>" for i in pad]
        elif key == "tokenizer.ggml.token_type":
            value = value + [gguf.TokenType.NORMAL] * len(pad)
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * len(pad)
        kind = field.types[0]
        w.add_key_value(key, value, kind, field.types[1] if kind == gguf.GGUFValueType.ARRAY else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a shipped dummy shape (e.g. llama-3.2-1b) or a config.json")
    p.add_argument("--type", required=True, choices=sorted(TYPES))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0, help="kvstrata's dummy seed (default 0, kvstrata's)")
    args = p.parse_args()
    source = dummy_source(args.model)
    mtype = source.config["model_type"]
    if mtype not in ARCHS:
        raise SystemExit(f"model_type {mtype!r}: no GGUF architecture for it here")
    ftype, qtype = TYPES[args.type]
    tensors = plan(source, qtype, args.seed)
    w = gguf.GGUFWriter(args.out, gguf.MODEL_ARCH_NAMES[ARCHS[mtype]])
    add_metadata(w, source, ftype, args.seed)
    total = 0
    for name, shape, tq, _ in tensors:                  # tensor infos first, data one tensor at a time
        block, size = gguf.GGML_QUANT_SIZES[tq]
        nbytes = math.prod(shape) // block * size
        total += nbytes
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=tq)
    print(f"{source.name} -> {args.out}: {len(tensors)} tensors, {total / 2**30:.2f} GiB, "
          f"{gguf.MODEL_ARCH_NAMES[ARCHS[mtype]]} {args.type}, seed {args.seed}", flush=True)
    w.write_header_to_file(args.out)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start, done = time.perf_counter(), 0
    for i, (name, shape, tq, make) in enumerate(tensors):
        data = encode(make(), tq)
        w.write_tensor_data(data)
        done += data.nbytes
        last_of_layer = i + 1 == len(tensors) or tensors[i + 1][0].split(".")[:2] != name.split(".")[:2]
        if not name.startswith("blk.") or last_of_layer:
            label = ".".join(name.split(".")[:2]) if name.startswith("blk.") else f"{name} ({tq.name})"
            print(f"  {label:32s} {done / 2**30:6.2f}/{total / 2**30:.2f} GiB  {time.perf_counter() - start:6.1f}s",
                  flush=True)
    w.close()
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
