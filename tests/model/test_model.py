"""The model path against transformers: tiny random models of every family (Llama's, Qwen 3's, Gemma 3's
sliding and global layers, Mistral's sliding window), every batch shape the runner produces (full prefill, paged
decode, chunked prefill, mixed), and SmolLM2 itself. The hybrid models' window (8) is shorter than their prompts,
so a sliding layer that read past it would not match."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from kvstrata.core.config import ModelConfig
from kvstrata.model.formats.dense import DenseLinear, PackedLinear, can_pack
from kvstrata.model.loader import load_model
from tests.model.model_helpers import Seq, greedy_chat, new_cache, run_step, save_tiny_hf_model

ATOL = 1e-4        # float32, logits of magnitude ~10
VOCAB = 256
BLOCK = 4          # small blocks: every sequence spans many, in shuffled order
WINDOW = 8         # the hybrid models' sliding window: two blocks

TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama3-rope": lambda: LlamaConfig(**TINY, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "linear-rope": lambda: LlamaConfig(**TINY, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama-bias": lambda: LlamaConfig(**TINY, attention_bias=True),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "mha-head-dim": lambda: LlamaConfig(**{**TINY, "num_key_value_heads": 4}, head_dim=32),
    "qwen3": lambda: Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True),
    "mistral-sliding": lambda: MistralConfig(**TINY, sliding_window=WINDOW),
    # a global layer between sliding ones, each kind with its RoPE; a query scale that is not head_dim's
    "gemma3": lambda: Gemma3TextConfig(**{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=WINDOW,
                                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                       query_pre_attn_scalar=24, rope_parameters={
                                           "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
HYBRID = ["gemma3", "mistral-sliding"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (our LoadedModel, the transformers model), built once per run."""
    built = {}

    def get(name: str):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            hf = save_tiny_hf_model(folder, CONFIGS[name]())
            ours = load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu"))
            built[name] = ours, hf
        return built[name]
    return get


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]       # (T, vocab)


def random_seqs(lengths: list[int], num_blocks: int, seed: int = 0) -> list[Seq]:
    """Sequences whose blocks are drawn from a shuffled pool, so block tables are non-contiguous."""
    rng = random.Random(seed)
    pool = list(range(1, num_blocks))          # block 0 stays unused: it is the table padding
    rng.shuffle(pool)
    seqs = []
    for length in lengths:
        need = -(-length // BLOCK)
        seqs.append(Seq([rng.randrange(VOCAB) for _ in range(length)], [pool.pop() for _ in range(need)]))
    return seqs


def assert_matches(seq: Seq, hf) -> None:
    ours = torch.stack(seq.logits)
    ref = hf_logits(hf, seq.tokens[:len(seq.logits)])
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_prefill_of_several_sequences_in_one_batch(tiny_models, name):
    ours, hf = tiny_models(name)
    seqs = random_seqs([5, 17, 33, 2], num_blocks=40)
    kv = new_cache(ours, 40, BLOCK)
    run_step(ours.model, kv, [(s, len(s.tokens)) for s in seqs])
    for seq in seqs:
        assert_matches(seq, hf)


@pytest.mark.parametrize("name", ["llama", *HYBRID])
def test_decode_step_by_step_through_shuffled_blocks(tiny_models, name):
    ours, hf = tiny_models(name)
    seqs = random_seqs([30, 45, 38], num_blocks=64, seed=1)
    kv = new_cache(ours, 64, BLOCK)
    prompts = [3, 9, 1]
    run_step(ours.model, kv, [(s, p) for s, p in zip(seqs, prompts, strict=True) if p > 1])
    run_step(ours.model, kv, [(seqs[2], 1)])                      # a one-token prompt is a decode
    while any(s.computed < len(s.tokens) for s in seqs):
        run_step(ours.model, kv, [(s, 1) for s in seqs if s.computed < len(s.tokens)])
    for seq in seqs:
        assert_matches(seq, hf)


@pytest.mark.parametrize("name", ["llama3-rope", *HYBRID])
def test_chunked_prefill_across_calls(tiny_models, name):
    ours, hf = tiny_models(name)
    (seq,) = random_seqs([61], num_blocks=20, seed=2)
    kv = new_cache(ours, 20, BLOCK)
    for chunk in (13, 16, 2, 30):                  # boundaries inside and on block edges
        run_step(ours.model, kv, [(seq, chunk)])
    assert_matches(seq, hf)


@pytest.mark.parametrize("name", ["qwen2", *HYBRID])
def test_mixed_batch_of_decodes_and_prefill_chunks(tiny_models, name):
    ours, hf = tiny_models(name)
    a, b, c, d = random_seqs([20, 26, 41, 11], num_blocks=40, seed=3)
    kv = new_cache(ours, 40, BLOCK)
    run_step(ours.model, kv, [(a, 17), (b, 24), (c, 9)])
    # two decodes, a continuing chunk and a fresh prompt, all in one forward
    run_step(ours.model, kv, [(a, 1), (b, 1), (c, 15), (d, 11)])
    run_step(ours.model, kv, [(a, 1), (b, 1), (c, 16)])
    run_step(ours.model, kv, [(a, 1), (c, 1)])
    for seq in (a, b, c, d):
        assert_matches(seq, hf)


def test_only_requested_rows_get_logits(tiny_models):
    from tests.model.model_helpers import make_batch

    ours, hf = tiny_models("llama")
    a, b = random_seqs([9, 12], num_blocks=10, seed=4)
    kv = new_cache(ours, 10, BLOCK)
    batch = make_batch([(a, 9), (b, 12)], BLOCK)
    batch.logits_indices = torch.tensor([8, 20])       # the last token of each
    logits = ours.model(batch, kv)
    assert logits.shape == (2, VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits[0], hf_logits(hf, a.tokens)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(hf, b.tokens)[-1], atol=ATOL, rtol=0)


def test_bfloat16_stays_close_to_float32(tiny_models, tmp_path):
    ours32, hf = tiny_models("llama")
    folder = tmp_path / "m"
    hf.save_pretrained(folder)
    ours16 = load_model(ModelConfig(model=str(folder), dtype="bfloat16", device="cpu"))
    assert ours16.model.embed_tokens.dtype == torch.bfloat16
    (s32,) = random_seqs([40], num_blocks=12, seed=5)
    s16 = Seq(list(s32.tokens), list(s32.blocks))
    for loaded, seq in ((ours32, s32), (ours16, s16)):
        kv = new_cache(loaded, 12, BLOCK)
        run_step(loaded.model, kv, [(seq, 30)])
        for _ in range(10):
            run_step(loaded.model, kv, [(seq, 1)])
    ref, got = torch.stack(s32.logits), torch.stack(s16.logits)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


# --- SmolLM2-135M-Instruct from its GGUF (the `smollm2_fp32` session fixture is in conftest.py) -------


def test_smollm2_logits_match_transformers_on_the_converted_weights(smollm2_fp32):
    hf = LlamaForCausalLM.from_pretrained(smollm2_fp32.folder, dtype=torch.float32).eval()
    text = smollm2_fp32.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about paging."}], add_generation_prompt=True,
        tokenize=False)
    tokens = smollm2_fp32.tokenizer(text, add_special_tokens=False)["input_ids"]
    seq = Seq(tokens, blocks=[7, 2, 5, 0, 3, 6, 1, 4][: -(-len(tokens) // 16)])
    kv = new_cache(smollm2_fp32, 8, 16)
    run_step(smollm2_fp32.model, kv, [(seq, len(tokens) - 5)])
    for _ in range(5):
        run_step(smollm2_fp32.model, kv, [(seq, 1)])
    torch.testing.assert_close(torch.stack(seq.logits), hf_logits(hf, tokens), atol=1e-3, rtol=0)


def test_smollm2_greedy_answer_names_paris(smollm2_fp32):
    answer = greedy_chat(smollm2_fp32, "What is the capital of France?")
    assert "Paris" in answer, answer


def test_the_default_model_at_its_gguf_bits_names_paris_when_asked_for_a_sentence(default_model):
    """What `make serve` loads: the shipped Q4_1 file at its own bits (the README's question)."""
    assert default_model.quantization == "gguf"
    answer = greedy_chat(default_model, "What is the capital of France? Answer in one sentence.")
    assert "Paris" in answer, answer


@pytest.mark.skipif(not can_pack(torch.empty(0)), reason="this torch has no oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 16, 40, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_f_linear(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in ((rows, 48), (96, 48), (96,)))
    if not can_pack(w):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for bias in (None, b):
        dense = DenseLinear(w, bias)
        y = PackedLinear.from_dense(dense)(x)
        assert y.shape == (rows, 96) and y.dtype == dtype
        torch.testing.assert_close(y, dense(x), atol=tol, rtol=tol)
