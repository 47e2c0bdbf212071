"""The engine on the real SmolLM2 weights: caching never changes greedy outputs, and every
step is audited (make_engine sets audit_every_step)."""

import asyncio
import dataclasses
import random
import threading

import pytest

from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.async_engine import AsyncLLMEngine
from tests.model.model_helpers import slow_without_native_bf16

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

SYSTEMS = [
    "You are a concise assistant. Answer in one short sentence and never apologise. ",
    "Context: the Loire is the longest river in France, flowing 1,006 kilometres to the Atlantic. ",
    "Instructions: translate the user's words into French, keeping the tone informal and warm. ",
]
QUESTIONS = ["What is two plus two?", "Name a colour.", "Where is Paris?", "Say hello.", "Count to three.",
             "What is water made of?", "Who wrote Hamlet?"]


def shared_prefix_prompts(n=24, seed=0):
    rng = random.Random(seed)
    prompts = [rng.choice(SYSTEMS) + rng.choice(QUESTIONS) for _ in range(n)]
    prompts.append(prompts[0])                       # an exact repeat: a full-prefix hit
    return prompts


def token_ids(outputs):
    return [o.new_token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(smollm2):
    """Greedy outputs with every cache feature off, one request at a time: the ground truth."""
    from kvstrata.core.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig.from_options(enable_prefix_caching=False, max_num_seqs=1,
                                                 kv_cache_memory="64MiB", audit_every_step=True), loaded=smollm2)
    return token_ids(engine.generate(shared_prefix_prompts(), GREEDY))


@pytest.mark.parametrize("options", [
    dict(),                                                         # caching on, batched
    dict(max_num_batched_tokens=7, block_size=4),                   # tiny chunks, tiny blocks
    dict(num_device_blocks=12, block_size=8, max_num_seqs=16),      # preemption by a tiny pool
], ids=["batched", "chunked", "preempting"])
def test_greedy_outputs_identical_with_caching_on_and_off(make_engine, reference, options):
    engine = make_engine(**options)
    outputs = engine.generate(shared_prefix_prompts(), GREEDY)
    assert token_ids(outputs) == reference
    assert sum(o.num_cached_tokens for o in outputs) > 0            # the cache was really used
    if "num_device_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    counts = engine.scheduler.tiers.audit()["device"]
    assert counts.used == 0 and counts.in_flight == 0


def test_full_prefix_hit_recomputes_the_last_token(make_engine):
    engine = make_engine(block_size=8)
    prompt = list(range(100, 132))                                  # exactly 4 blocks
    first, = engine.generate([prompt], GREEDY)
    again, = engine.generate([prompt], GREEDY)
    assert again.num_cached_tokens == 24 and again.new_token_ids == first.new_token_ids


def test_smollm2_knows_the_capital_of_france(make_engine):
    engine = make_engine()
    prompt = engine.chat_prompt([{"role": "user",
                                  "content": "What is the capital of France? Answer in one sentence."}])
    out, = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert "Paris" in out.text and out.finish_reason == "stop"


def test_seeded_sampling_reproduces(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    a, b = engine.generate(["Once upon a time", "Once upon a time"], params)
    c, = engine.generate(["Once upon a time"], SamplingParams(max_tokens=10, temperature=1.0, seed=99))
    assert a.new_token_ids == b.new_token_ids != c.new_token_ids


def test_stop_strings_cut_the_text_and_finish_with_stop(make_engine):
    engine = make_engine()
    free, = engine.generate(["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=12, temperature=0.0))
    stop_at = free.text.strip().split()[1]                         # the second number it writes
    out, = engine.generate(["1, 2, 3, 4, 5,"], SamplingParams(max_tokens=12, temperature=0.0, stop=(stop_at,)))
    assert out.finish_reason == "stop" and stop_at not in out.text
    assert free.text.startswith(out.text)


def test_logprobs_are_returned_per_token(make_engine):
    engine = make_engine()
    out, = engine.generate(["The sky is"], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))
    assert len(out.logprobs) == 3
    for token, entry in zip(out.new_token_ids, out.logprobs):
        assert entry.token_id == token and len(entry.top) == 2 and entry.top[0][0] == token   # greedy: best


def test_requests_too_long_are_refused_before_queueing(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished


def test_abort_releases_blocks(make_engine):
    engine = make_engine()
    engine.add_request("Tell me a long story about a dragon.", GREEDY, request_id="a")
    engine.step()
    out, = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    counts = engine.scheduler.tiers.audit()["device"]
    assert counts.used == 0 and not engine.has_unfinished


def test_async_engine_streams_and_cancelling_aborts(make_engine):
    engine = make_engine()
    async_engine = AsyncLLMEngine(engine).start()

    async def consume(prompt, stop_after=None):
        text, n = "", 0
        async for out in async_engine.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0)):
            text += out.text
            n += 1
            if stop_after is not None and n >= stop_after:
                break                               # leaving the iterator aborts the request
        return text

    async def main():
        return await asyncio.gather(consume("The capital of France is"), consume("One, two,", stop_after=2),
                                    consume("The capital of France is"))

    try:
        full, cut, again = asyncio.run(main())
        assert full == again and len(full) > len(cut)
        for _ in range(100):
            if not engine.has_unfinished:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert not engine.has_unfinished
        for _ in range(250):                        # idle, it maps the rest of its KV pages ahead
            if engine.runner.kv.unmapped_bytes == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert engine.runner.kv.unmapped_bytes == 0
        for _ in range(100):                        # and says so to /metrics (kvstrata_kv_unmapped_bytes)
            if async_engine.snapshot.kv_unmapped_bytes == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert async_engine.snapshot.kv_unmapped_bytes == 0
    finally:
        async_engine.shutdown()
    counts = engine.scheduler.tiers.audit()["device"]
    assert counts.used == 0 and counts.in_flight == 0


def test_async_engine_reports_bad_requests_to_their_caller(make_engine):
    engine = make_engine(max_model_len=32)
    async_engine = AsyncLLMEngine(engine).start()

    async def main():
        with pytest.raises(ValueError, match="at most 32 tokens"):
            async for _ in async_engine.generate(list(range(40)), SamplingParams(max_tokens=4)):
                pass
        return [o async for o in async_engine.generate("Hi", SamplingParams(max_tokens=2))]

    try:
        assert asyncio.run(main())[-1].finished
    finally:
        async_engine.shutdown()


def test_async_engine_builds_its_engine_on_its_own_thread(make_engine):
    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return make_engine()

    async_engine = AsyncLLMEngine(build).start()
    try:
        async def main():
            return [o async for o in async_engine.generate("Hi", SamplingParams(max_tokens=2))]

        assert asyncio.run(main())[-1].finished
        assert built_on == ["kvstrata-engine"]
    finally:
        async_engine.shutdown()

    def broken():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine(broken).start()


@slow_without_native_bf16
def test_batch_invariant_bf16_outputs_equal_with_caching_on_and_off():
    """`--batch-invariant` gives a bfloat16 model float32's promise: greedy outputs with caching on and
    batching equal one request at a time with caching off (without it, 22-23 of these 25 measured
    equal on this project's machine: bf16 turns batch-dependent float32 last bits into tokens)."""
    from kvstrata.core.config import EngineConfig, ModelConfig
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.model.loader import load_model

    loaded = load_model(ModelConfig(dtype="bfloat16", device="cpu", batch_invariant=True))
    plain = load_model(ModelConfig(dtype="bfloat16", device="cpu"))
    assert loaded.fingerprint != plain.fingerprint                  # neither ever loads the other's KV
    assert load_model(ModelConfig(dtype="float32", device="cpu", batch_invariant=True)).fingerprint == \
        load_model(ModelConfig(dtype="float32", device="cpu")).fingerprint   # float32 sums are unchanged

    def run(**opts):
        engine = LLMEngine(EngineConfig.from_options(kv_cache_memory="64MiB", audit_every_step=True, **opts),
                           loaded=loaded)
        return engine.generate(shared_prefix_prompts(), GREEDY)

    off = run(enable_prefix_caching=False, max_num_seqs=1)
    on = run()
    assert token_ids(on) == token_ids(off)
    assert sum(o.num_cached_tokens for o in on) > 0                 # the cache was really used


@slow_without_native_bf16
@pytest.mark.parametrize("path", ["in-place", "gathered"])
def test_batch_invariant_bf16_logits_are_the_same_bits_alone_batched_and_chunked(path):
    """Below the greedy tokens: every logit of `--batch-invariant` bf16 is bit-identical whether a
    sequence runs alone, in a batch of eight (prefills together, then decodes together), or has its
    prompt computed in two chunks; decode attention in the paged kernel or gathered. Without the
    lone-row padding of the projections, 2 to 7 of these 8 sequences differed."""
    import torch

    from kvstrata.core.config import ModelConfig
    from kvstrata.model.loader import load_model
    from kvstrata.model.network.decoder import DecoderModel
    from tests.model.model_helpers import Seq, new_cache, run_step

    loaded = load_model(ModelConfig(dtype="bfloat16", device="cpu", batch_invariant=True))
    assert loaded.model.attn.reads_in_place(16, torch.bfloat16, torch.device("cpu")), "no paged kernel"
    if path == "gathered":               # the same weights, assembled without the kernel
        loaded.model = DecoderModel(loaded.model.parts, dataclasses.replace(loaded.model.kernels, paged=None))
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(20, 120))] for _ in range(8)]
    steps = 5

    def blocks(i):
        return list(range(1 + 20 * i, 21 + 20 * i))

    def decode(kv, seqs):
        for _ in range(steps):
            for seq in seqs:
                seq.tokens.append(int(seq.logits[-1].argmax()))
            run_step(loaded.model, kv, [(seq, 1) for seq in seqs])

    alone, kv = [], new_cache(loaded, 400)
    for i, prompt in enumerate(prompts):
        seq = Seq(list(prompt), blocks(i))
        if i % 2:                                                   # as if a cache hit had left 16 tokens
            run_step(loaded.model, kv, [(seq, 16)])
        run_step(loaded.model, kv, [(seq, len(prompt) - seq.computed)])
        decode(kv, [seq])
        alone.append(torch.stack(seq.logits[-steps - 1:]))
    batched, kv = [Seq(list(p), blocks(i)) for i, p in enumerate(prompts)], new_cache(loaded, 400)
    run_step(loaded.model, kv, [(seq, len(seq.tokens)) for seq in batched])
    decode(kv, batched)
    assert [torch.equal(a, torch.stack(b.logits[-steps - 1:])) for a, b in zip(alone, batched)] == [True] * 8


def test_generate_takes_token_id_prompts_and_scores_them(make_engine, smollm2):
    """vLLM's offline API: token-id prompts in a list, prompt_logprobs (the first None), constraints."""
    engine = make_engine(host_cache_memory="16MiB")
    prompts = [engine.prompts.encode(p) for p in ("The capital of France is", "One, two, three,")]
    plain = engine.generate(prompts, GREEDY)
    scored = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                     prompt_logprobs=1, logprobs=0))
    for ids, out, again in zip(prompts, plain, scored):
        assert again.new_token_ids == out.new_token_ids and again.prompt_token_ids == ids
        assert again.prompt_logprobs[0] is None and len(again.prompt_logprobs) == len(ids)
        assert [e.token_id for e in again.prompt_logprobs[1:]] == ids[1:]
        assert all(e.logprob <= 0 and len(e.top) == 1 for e in again.prompt_logprobs[1:])
    first = plain[0].new_token_ids[0]
    steered = engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, logit_bias={first: -100},
                                                          bad_words=("Paris",)))[0]
    assert steered.new_token_ids[0] != first and "Paris" not in steered.text
    allowed = engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=1.0, seed=2, ignore_eos=True,
                                                          allowed_token_ids=(first, 11, 12)))[0]
    assert set(allowed.new_token_ids) <= {first, 11, 12}
    assert engine.tiers.audit()["device"].used == 0
