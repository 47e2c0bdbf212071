"""Gemma 3 from a GGUF file as llama.cpp writes it (norms stored as 1 + w, no q/k permutation, the layer pattern
and the local RoPE base implied), against transformers on the HF model it was written from; the descriptions of
the new families' configs; the packaged real file (slow: parity with transformers on its own weights)."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.core.shapes import shipped_config
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.kvcache.faults import FaultInjector
from kvstrata.model.arch import describe
from kvstrata.model.formats.gguf import GGUFParts
from kvstrata.model.loader import load_model
from tests.model.model_helpers import Seq, new_cache, run_step, save_tiny_hf_model, write_tiny_gguf

WINDOW = 8
# six layers: the pattern a GGUF implies puts the one global layer last; the scalar a GGUF implies is head_dim's
TINY_GEMMA3 = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                               max_position_embeddings=256, sliding_window=WINDOW, rms_norm_eps=1e-6)


def test_a_gemma3_gguf_gives_transformers_logits_through_prefill_and_decodes(tmp_path):
    hf = save_tiny_hf_model(tmp_path / "hf", TINY_GEMMA3, seed=3)
    path = tmp_path / "Tiny-Gemma3.F32.gguf"
    write_tiny_gguf(path, hf)
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", quantization="none"))
    a = loaded.arch
    assert a.windows == (WINDOW,) * 5 + (None,) and a.local_rope_theta == 10_000.0 and a.norm_style == "gemma"
    tokens = [(7 * i + 3) % 128 for i in range(40)]            # five windows long
    seq = Seq(list(tokens), blocks=list(range(12, 1, -1)))
    kv = new_cache(loaded, 13, 4)
    run_step(loaded.model, kv, [(seq, 23)])                   # a prompt of 23, then a decode at a time
    while seq.computed < len(tokens):
        run_step(loaded.model, kv, [(seq, 1)])
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(torch.stack(seq.logits), reference, atol=1e-4, rtol=0)


# A Q4_K_M file's kinds where a tiny model's 64-wide rows allow them (K-quants need rows of 256): q and k in
# Q5_0 beside v in Q8_0 (one projection of two kinds), the MLP in Q5_1 and Q4_0
MIXED_5BIT = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_gate": "Q5_1",
              "ffn_up": "Q5_1", "ffn_down": "Q8_0", "token_embd": "Q8_0"}


def test_greedy_outputs_at_its_bits_are_the_same_with_every_cache_feature_on_as_off(tmp_path):
    """Prompts eight windows long: prefix caching, a host tier and the disk store, preemption, a restart over the
    store, a prefill/decode handoff through the store and speculative decoding, with the sliding layers keeping
    their window only (KV groups: every group's pages loaded from host and store, copies and loads that fail and
    send the request back to wait), against none of them and full-length KV. A full-length engine on the same
    store reads none of the grouped engines' records and deletes none."""
    hf = save_tiny_hf_model(tmp_path / "hf", TINY_GEMMA3, seed=5)
    path = tmp_path / "Tiny-Gemma3.Q5_0.gguf"
    write_tiny_gguf(path, hf, MIXED_5BIT)
    loaded = load_model(ModelConfig(model=str(path)))
    assert loaded.runs()["quantization"] == "gguf" and loaded.dtype == torch.bfloat16
    assert isinstance(loaded.model.layers[0].projections["qkv"], GGUFParts)
    shared = [5 + (i * 7) % 50 for i in range(64)]           # repeats: the n-gram drafts find their matches
    prompts = [shared + [i, i + 1, i + 2] for i in range(6)] + [shared[:40]]
    filler = [100 + (i * 3) % 27 for i in range(100)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    store = str(tmp_path / "store")

    def run(faults=None, **options) -> tuple[list[list[int]], dict[str, int]]:
        engine = LLMEngine(EngineConfig.from_options(audit_every_step=True, block_size=4, **options), loaded=loaded,
                           faults=faults)
        outs = engine.generate(prompts[:3], params) + engine.generate([filler], params)   # pushes them down
        outs += engine.generate(prompts[3:], params)
        stats = engine.tiers.stats
        counts = {**stats.hit_tokens, "accepted": sum(out.num_accepted_draft_tokens for out in outs),
                  "preempted": engine.scheduler.num_preemptions, "released": stats.window_released,
                  "window_hits": stats.window_hits, "groups": engine.tiers.groups is not None,
                  "group_loads": sum(stats.group_loads.values()), "restarts": stats.restarts}
        engine.close()
        return [out.new_token_ids for out in outs], counts

    def handed_over() -> tuple[list[list[int]], int]:
        """A prefill engine hands each prompt's blocks over through the store; a decode engine generates."""
        options = {"audit_every_step": True, "block_size": 4, "num_device_blocks": 256, "store": "disk",
                   "store_path": str(tmp_path / "handoff")}
        prefill = LLMEngine(EngineConfig.from_options(write_policy="write_through", **options), loaded=loaded)
        for index, prompt in enumerate(prompts):
            prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), f"prefill-{index}", hand_off=True)
        while prefill.has_unfinished:
            prefill.step()
        prefill.close()
        decode = LLMEngine(EngineConfig.from_options(**options), loaded=loaded)
        outs = decode.generate(prompts, params)
        loaded_tokens = decode.tiers.stats.hit_tokens["store"]
        decode.close()
        return [out.new_token_ids for out in outs], loaded_tokens

    plain, plain_hits = run(num_device_blocks=256, enable_prefix_caching=False, swa_full=True)
    grouped, windowed = run(num_device_blocks=80, max_num_batched_tokens=16)
    tiered = {"max_num_batched_tokens": 16, "store": "disk", "store_path": store}    # pages of 6 groups of 1 layer
    cached, hits = run(num_device_blocks=80, num_host_blocks=192, **tiered)
    restarted, again = run(num_device_blocks=80, **tiered)
    faulted, failed = run(FaultInjector(every={"copy": 3, "decode": 4}), num_device_blocks=80, num_host_blocks=192,
                          **tiered)
    records = {p.name for p in (tmp_path / "store").rglob("*") if p.is_file()}
    full, apart = run(num_device_blocks=256, swa_full=True, **tiered)      # every layer at full length: other keys
    assert records and apart["store"] == 0 and records <= {p.name for p in (tmp_path / "store").rglob("*")}
    drafted, accepted = run(num_device_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    decoded, handed = handed_over()
    assert not plain_hits["groups"] and windowed["groups"] and hits["groups"] and accepted["groups"]
    assert hits["group_loads"] > 0 and again["group_loads"] > 0 and failed["restarts"] > 0, (hits, again, failed)
    assert plain_hits["device"] + plain_hits["released"] == 0 and hits["host"] > 0 and again["store"] > 0, (hits, again)
    assert windowed["device"] > 0 and windowed["preempted"] > 0 and windowed["released"] > 0, windowed
    assert windowed["window_hits"] > 0, windowed
    assert hits["preempted"] > 0 and accepted["accepted"] > 0 and handed > 0, (hits, accepted, handed)
    assert all(len(out) == 24 for out in plain) and cached == plain and restarted == plain and drafted == plain
    assert grouped == plain and faulted == plain and full == plain
    assert decoded == plain[:3] + plain[4:]         # the filler is not handed over


@pytest.mark.parametrize(("shape", "windows", "global_layers"), [
    ("gemma-3-1b", {512}, 4), ("gemma-3-4b", {1024}, 5), ("gemma-3-12b", {1024}, 8), ("qwen3-8b", set(), 36)])
def test_the_shipped_shapes_describe_their_layers(shape, windows, global_layers):
    a = describe(shipped_config(shape))
    assert {w for w in a.windows if w} == windows
    assert sum(a.window(i) is None for i in range(a.num_layers)) == global_layers
    assert a.qk_norm and not a.plain_layers


def test_mistral_and_qwen_sliding_windows_are_applied_as_transformers_reads_them():
    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    assert describe({**base, "model_type": "mistral", "sliding_window": 4096}).windows == (4096,) * 4
    assert describe({**base, "model_type": "mistral", "sliding_window": None}).windows == ()
    assert describe({**base, "model_type": "qwen2", "sliding_window": 4096}).windows == ()   # use_sliding_window off
    assert describe({**base, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
                     "max_window_layers": 2}).windows == (None, None, 64, 64)


def test_what_gemma3_cannot_run_is_refused_by_name():
    config = {**TINY_GEMMA3.to_dict(), "final_logit_softcapping": 30.0}
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        describe(config)
    with pytest.raises(ValueError, match="int8"):
        load_model(ModelConfig(model="gemma-3-1b", load_format="dummy", quantization="int8"))


@pytest.mark.slow
def test_the_packaged_gemma3_270m_matches_transformers_on_its_own_file():
    """The real file (Q4_K_M) widened to float32 against transformers' own GGUF loader on the same file: 600
    tokens, past the window of 512, every position's log-likelihood."""
    transformers = pytest.importorskip("transformers")
    from kvstrata.model.sources.packaged import packaged_path

    path = packaged_path("gemma-3-270m")
    loaded = load_model(ModelConfig(model="gemma-3-270m", dtype="float32", quantization="none"))
    text = " ".join(f"Line {i}: the river runs past the mill and the town of Ash {i * 7 % 13}." for i in range(48))
    tokens = loaded.tokenizer(text)["input_ids"][:600]
    assert len(tokens) == 600
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    seq = Seq(list(tokens), blocks=list(range(1, 40)))
    kv = new_cache(loaded, 40, 16)
    run_step(loaded.model, kv, [(seq, 300)])
    for chunk in (200, 100):                               # chunked across the window's edge
        run_step(loaded.model, kv, [(seq, chunk)])
    ours = torch.log_softmax(torch.stack(seq.logits), -1)
    picked = torch.tensor(tokens[1:])[:, None]
    diff = (ours[:-1].gather(1, picked) - reference[:-1].gather(1, picked)).abs()
    assert float(diff.max()) < 0.02 and float(diff.mean()) < 0.002, (float(diff.max()), float(diff.mean()))
