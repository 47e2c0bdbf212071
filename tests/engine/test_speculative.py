"""Speculative decoding on the real SmolLM2 weights: greedy outputs are token for token those of
plain decoding, with n-gram drafts and with predicted outputs, on a prompt that repeats itself and
on prompts that do not, with prefix caching and the host tier on and every step audited."""

import pytest

from kvstrata.core.sampling_params import SamplingParams
from tests.engine.test_engine import shared_prefix_prompts

CODE = ("def total(values):\n    result = 0\n    for value in values:\n        result = result + value\n"
        "    return result\n")
REPEATING = f"Rewrite this code, renaming `result` to `acc` and changing nothing else:\n\n{CODE}\nRewritten:\n"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TIERS = {"host_cache_memory": "16MiB", "block_size": 8}


def greedy(max_tokens=40, **options):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **options)


def prompts():
    return [REPEATING] + shared_prefix_prompts(4)


@pytest.fixture(scope="module")
def reference(smollm2):
    from kvstrata.core.config import EngineConfig
    from kvstrata.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig.from_options(enable_prefix_caching=False, kv_cache_memory="64MiB",
                                                 audit_every_step=True), loaded=smollm2)
    return engine, {name: engine.generate(prompts(), params) for name, params in PARAMS.items()}


PARAMS = {"greedy": greedy(), "penalties": greedy(repetition_penalty=1.2, frequency_penalty=0.3),
          "min_tokens": greedy(min_tokens=30), "stop": greedy(stop=("acc",))}


@pytest.mark.parametrize("name", PARAMS)
def test_ngram_greedy_outputs_equal_plain_decoding(make_engine, reference, name):
    engine = make_engine(speculative_config=NGRAM, **TIERS)
    outputs = engine.generate(prompts(), PARAMS[name])
    expected = reference[1][name]
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
    assert [(o.text, o.finish_reason, o.num_output_tokens) for o in outputs] == \
        [(o.text, o.finish_reason, o.num_output_tokens) for o in expected]
    stats = engine.stats
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert engine.scheduler.tiers.audit()["device"].used == 0


def test_predicted_outputs_draft_from_the_prediction(make_engine, reference):
    plain = reference[1]["greedy"][0]
    engine = make_engine(**TIERS)                                    # no --speculative-config: the prediction drafts
    right = engine.add_request(REPEATING, greedy(), prediction=plain.text)
    wrong = engine.add_request(REPEATING, greedy(), prediction="Something else entirely, " * 4)
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert outputs[right.request_id] == outputs[wrong.request_id] == plain.new_token_ids
    assert right.num_accepted_tokens >= 0.7 * right.num_output_tokens     # most tokens come from the prediction
    assert right.num_accepted_tokens > wrong.num_accepted_tokens


def test_sampled_requests_speculate_and_seeded_ones_repeat(make_engine):
    engine = make_engine(speculative_config=NGRAM)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=11)
    first, second = (engine.generate([REPEATING], params)[0] for _ in range(2))
    assert first.new_token_ids == second.new_token_ids and engine.stats.spec_decode_num_drafts > 0


def test_requests_verification_cannot_serve_exactly_do_not_speculate(make_engine):
    engine = make_engine(speculative_config=NGRAM)
    cases = [(greedy(logprobs=2), 0), (SamplingParams(n=2, temperature=0.5, max_tokens=8), 0), (greedy(), 4)]
    for params, lookahead in cases:
        assert engine.add_request(REPEATING, params).num_lookahead_tokens == lookahead
    while engine.has_unfinished:
        engine.step()
