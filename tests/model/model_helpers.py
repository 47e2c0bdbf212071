"""Test helpers: build `ForwardBatch`es by hand (the runner's job in the engine) and tiny HF models."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from kvstrata.core.machine import machine
from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from kvstrata.model.loader import LoadedModel
from kvstrata.model.network.forward_batch import DecodeGroup, ForwardBatch

# For a test of our C++ kernels: they run here unless deliberately off (KVSTRATA_KERNELS=0); a kernel that fails
# to build fails the test, never skips it.
kernels_on = pytest.mark.skipif(os.environ.get("KVSTRATA_KERNELS") == "0", reason="KVSTRATA_KERNELS=0")


def slow_without_native_bf16(test):
    """For a test that runs SmolLM2 in bf16: where the CPU has no AVX512-BF16 / AMX, oneDNN emulates
    bf16 several times slower than fp32, so there the test runs with `-m slow` (`.ci/run` runs both)."""
    return test if machine().native_bf16 else pytest.mark.slow(test)


def cuda_only(test):
    """For a test of the CUDA paths: skipped without a CUDA device (CI has none);
    `benchmarks/device_check.py` runs them on a GPU machine with `-m cuda`."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@dataclass
class Seq:
    """One sequence's tokens and the (deliberately arbitrary) blocks holding its KV."""

    tokens: list[int]
    blocks: list[int]
    computed: int = 0                 # tokens whose K/V are already in the cache
    logits: list[torch.Tensor] = field(default_factory=list)   # one row per computed token


def make_batch(work: list[tuple[Seq, int]], block_size: int, groups: list[DecodeGroup] = ()) -> ForwardBatch:
    """Compute the next `n` tokens of each `seq`; items with n == 1 must come first (decodes), those
    of `groups` (decodes sharing their leading blocks) at the front."""
    ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
    num_decodes = 0
    while num_decodes < len(work) and work[num_decodes][1] == 1:
        num_decodes += 1
    assert all(n > 1 for _, n in work[num_decodes:]), "decodes (one token) must come first"
    width = max(len(seq.blocks) for seq, _ in work)
    tables = torch.zeros(len(work), width, dtype=torch.int64)
    for row, (seq, n) in enumerate(work):
        for pos in range(seq.computed, seq.computed + n):
            ids.append(seq.tokens[pos])
            positions.append(pos)
            slots.append(seq.blocks[pos // block_size] * block_size + pos % block_size)
        tables[row, :len(seq.blocks)] = torch.tensor(seq.blocks)
        qsl.append(qsl[-1] + n)
        seq_lens.append(seq.computed + n)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=torch.tensor(seq_lens),
        query_start_loc=qsl, num_decodes=num_decodes, logits_indices=torch.arange(len(ids)),
        decode_groups=list(groups))


def run_step(model, kv: PagedKVCache, work: list[tuple[Seq, int]], groups: list[DecodeGroup] = ()) -> torch.Tensor:
    """One forward over `work`; appends each computed token's logits to its Seq and advances it.
    Returns the logits, one row per computed token."""
    logits = model(make_batch(work, kv.block_size, groups), kv)
    row = 0
    for seq, n in work:
        seq.logits.extend(logits[row:row + n])
        seq.computed += n
        row += n
    return logits


def new_cache(loaded: LoadedModel, num_blocks: int, block_size: int = 16) -> PagedKVCache:
    return PagedKVCache(KVCacheSpec.for_model(loaded.arch, block_size, loaded.dtype), num_blocks)


def save_tiny_hf_model(folder: Path, config, seed: int = 0, tokenizer=None):
    """Random HF model with weights large enough that attention is far from uniform; returns it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model


def greedy_chat(loaded: LoadedModel, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy decode straight on the model and a PagedKVCache (the engine lives elsewhere)."""
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True, tokenize=False)
    tokens = loaded.tokenizer(ids, add_special_tokens=False)["input_ids"]
    block_size = 16
    need = -(-(len(tokens) + max_new_tokens) // block_size)
    kv = new_cache(loaded, need + 3, block_size)
    seq = Seq(list(tokens), blocks=list(range(need + 2, 2, -1))[:need])   # reversed, not from 0
    run_step(loaded.model, kv, [(seq, len(tokens))])
    out = []
    for _ in range(max_new_tokens):
        token = int(seq.logits[-1].argmax())
        if token in loaded.eos_token_ids:
            break
        out.append(token)
        seq.tokens.append(token)
        run_step(loaded.model, kv, [(seq, 1)])
    return loaded.tokenizer.decode(out)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's permute, written out independently of our inverse."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, hf_model, types: dict[str, str] | None = None) -> None:
    """The tiny HF model as llama.cpp would write it: GGUF names, permuted q/k (llama), Gemma's norms as 1 + w,
    F32 tensors unless `types` names another GGUF type for a matrix (by its GGUF name without the layer, e.g.
    ffn_down, token_embd), quantized by gguf-py. Llama and Gemma 3 configs."""
    c = hf_model.config
    gemma = c.model_type == "gemma3_text"
    writer = gguf.GGUFWriter(str(path), "gemma3" if gemma else "llama")
    if gemma:            # llama.cpp's writer: the window and head size; the pattern and local base are implied
        writer.add_sliding_window(c.sliding_window)
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"] if gemma else 10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    if gemma:
        names |= {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm", "self_attn.q_norm": "attn_q_norm",
                  "self_attn.k_norm": "attn_k_norm"}

    def add(kind: str, name: str, w: np.ndarray) -> None:
        qtype = gguf.GGMLQuantizationType[(types or {}).get(kind, "F32")]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    scaling = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})   # v5 / v4
    if scaling.get("rope_type") == "llama3":           # as convert_hf_to_gguf.py writes it: one factor per frequency
        dim = c.hidden_size // c.num_attention_heads
        low, high = scaling["original_max_position_embeddings"] / np.array([scaling["low_freq_factor"],
                                                                             scaling["high_freq_factor"]])
        factors = []
        for freq in 1.0 / scaling.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim):
            wavelen = 2 * np.pi / freq
            smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / \
                (scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1.0 if wavelen < high else scaling["factor"] if wavelen > low
                           else 1 / ((1 - smooth) / scaling["factor"] + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for name, t in hf_model.state_dict().items():
        w = t.numpy().copy()
        if gemma and name.endswith("norm.weight"):
            w = w + np.float32(1)                      # llama.cpp stores Gemma's norms with their 1 added
        if name == "lm_head.weight":
            continue                                   # tied: llama.cpp writes no output.weight
        if name == "model.embed_tokens.weight":
            add("token_embd", "token_embd.weight", w)
            continue
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        part = rest.removesuffix(".weight")
        if part == "self_attn.q_proj" and not gemma:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif part == "self_attn.k_proj" and not gemma:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        add(names[part], f"blk.{layer}.{names[part]}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# A Llama small enough to write as a GGUF in a test (rows of 64 and 96: whole blocks of 32)
TINY_LLAMA = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


# Every matrix of a tiny GGUF by its GGUF name without the layer (the keys of `write_tiny_gguf`'s `types`)
GGUF_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd")
ALL_BF16 = dict.fromkeys(GGUF_MATRICES, "BF16")


def tiny_gguf(folder: Path, config, types: dict[str, str], seed: int = 0) -> Path:
    """A random tiny HF model (`save_tiny_hf_model`) written as a GGUF with `types` (`write_tiny_gguf`); its path."""
    hf = save_tiny_hf_model(folder / "hf", config, seed=seed)
    path = folder / "Tiny-Llama.Q4_0.gguf"
    write_tiny_gguf(path, hf, types)
    return path
