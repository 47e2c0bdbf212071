"""Parallel sampling (n, best_of) with the official `openai` client against a live server, and the
engine's counters: the prompt is computed once per family, and every block comes back."""

import httpx
import openai
import pytest

from kvstrata.core.sampling_params import SamplingParams
from kvstrata.kvcache.faults import FaultInjector
from tests.entrypoints.openai.test_server import client, server  # noqa: F401  (fixtures: a live server of 256 blocks of 16, its client)
from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, wait_idle

PROMPT = "Write one sentence about a lighthouse keeper who finds a strange map in a bottle"


def computed(engine) -> int:
    return engine.stats.prompt_tokens_computed


def at_rest(server) -> None:
    base, engine = server
    wait_idle(engine)
    engine.scheduler.audit()
    assert blocks_at_rest(base)["used"] == 0 and blocks_at_rest(base)["in_flight"] == 0


def test_n_samples_share_one_prefill_and_are_reproducible(server, client):
    _, engine = server
    kwargs = dict(model=MODEL, prompt=f"(first) {PROMPT}", max_tokens=12, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    before = computed(engine)
    reply = client.completions.create(n=3, **kwargs)
    assert computed(engine) - before == reply.usage.prompt_tokens          # one prefill for three samples
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.text for c in reply.choices]
    assert len(set(texts)) > 1                                             # each sample its own seed stream
    assert reply.usage.completion_tokens == 12 * 3 and reply.usage.prompt_tokens > 16
    again = client.completions.create(n=3, **kwargs)
    assert [c.text for c in again.choices] == texts
    # Sample i draws from seed + i: a lone request with that seed gives the same text.
    alone = client.completions.create(n=1, **{**kwargs, "seed": 8})
    assert alone.choices[0].text == texts[1]
    at_rest(server)


def test_separate_requests_compute_more_of_the_prompt_than_a_family(server, client):
    _, engine = server
    kwargs = dict(model=MODEL, max_tokens=2, temperature=1.0)
    before = computed(engine)
    family = client.completions.create(prompt=f"(family) {PROMPT}", n=4, **kwargs)
    family_cost = computed(engine) - before
    before = computed(engine)
    for _ in range(4):
        client.completions.create(prompt=f"(apart) {PROMPT}", **kwargs)
    apart_cost = computed(engine) - before
    prompt_tokens = family.usage.prompt_tokens
    assert family_cost == prompt_tokens
    assert apart_cost > family_cost          # the last token (and partial block) is recomputed by each
    at_rest(server)


def test_best_of_returns_the_n_of_highest_cumulative_logprob(server, client):
    kwargs = dict(model=MODEL, prompt=f"(best) {PROMPT}", max_tokens=8, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == sorted(scores, key=scores.get, reverse=True)[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)                   # scored, but not asked for
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every.choices
                                               if c.text in {b.text for b in best.choices})
    at_rest(server)


def test_chat_streaming_carries_each_sample_index(server, client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10,
                  temperature=1.0, seed=3, n=3)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens            # counted once
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    at_rest(server)


def test_leaving_a_streamed_family_early_aborts_every_sample(server, client):
    stream = client.completions.create(model=MODEL, prompt=f"(left) {PROMPT}", max_tokens=200, n=3,
                                       temperature=1.0, stream=True,
                                       extra_body={"ignore_eos": True})
    for seen, _ in enumerate(stream):
        if seen == 6:
            break
    stream.close()
    at_rest(server)


def test_a_family_that_cannot_fit_a_small_pool_is_refused_whole(smollm2):
    # 12 blocks of 16: a ~20-token prompt with 40 new tokens needs 4 blocks; each other sample 3 more.
    with running_server(smollm2, num_device_blocks=12, block_size=16) as (base, engine):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=1.0)
        with pytest.raises(openai.BadRequestError, match="KV blocks") as refused:
            client.completions.create(n=4, **kwargs)
        assert refused.value.body["param"] == "max_tokens"
        assert not engine.has_unfinished and computed(engine) == 0
        assert blocks_at_rest(base) == {"free": 12, "cached": 0, "used": 0, "in_flight": 0}
        reply = client.completions.create(n=3, **kwargs)                  # 4 + 2 * 3 = 10 fits
        assert len(reply.choices) == 3
        wait_idle(engine)
        assert blocks_at_rest(base)["used"] == 0
        assert httpx.get(f"{base}/health").status_code == 200


def test_the_llm_engine_returns_n_outputs_per_prompt_best_first_with_best_of(make_engine):
    engine = make_engine()
    outputs = engine.generate(["The sea is", "A map"], SamplingParams(n=2, best_of=3, seed=5, max_tokens=5))
    assert [(o.request_id[-1], o.index) for o in outputs] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    for pair in (outputs[:2], outputs[2:]):
        assert pair[0].cumulative_logprob >= pair[1].cumulative_logprob
        assert all(not o.logprobs and len(o.new_token_ids) == 5 for o in pair)
    assert engine.tiers.audit()["device"].used == 0


def test_a_failed_prefill_ends_every_sample_of_the_family_and_returns_every_block(make_engine):
    faults = FaultInjector()
    engine = make_engine(faults=faults)
    faults.arm("execute")                                   # the leader's prefill step raises
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=4), request_id="f")
    outputs = engine.step()
    assert sorted((o.request_id, o.index, o.finish_reason) for o in outputs) == [("f", i, "error") for i in range(3)]
    assert not engine.has_unfinished and engine.tiers.audit()["device"].used == 0
    assert engine.abort("f") == []                          # nothing left to abort
