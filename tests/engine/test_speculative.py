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


def test_every_kind_of_request_speculates(make_engine):
    from kvstrata.core.sampling_params import GrammarSpec

    engine = make_engine(speculative_config=NGRAM)
    cases = [greedy(structured=GrammarSpec("regex", "[a-z ]+")), greedy(logprobs=2),
             SamplingParams(n=2, temperature=0.5, max_tokens=8), greedy()]
    for params in cases:
        assert engine.add_request(REPEATING, params).num_lookahead_tokens == 4
    while engine.has_unfinished:
        engine.step()


GRAMMARS = {"regex": ("regex", "[a-z_ =+():\n]{8,60}"),
            "json": ("json_schema", '{"type": "object", "properties": {"name": {"type": "string"}, "body": '
                                    '{"type": "string"}}, "required": ["name", "body"]}')}


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_structured_output_speculates_and_keeps_plain_outputs(make_engine, grammar):
    """Each verification row masked by the grammar after its drafts: greedy structured outputs with
    n-gram drafts equal plain ones token for token, and drafts the grammar forbids are rejected
    (the drafts come from a prompt full of tokens the grammar does not allow in every place)."""
    import json
    import re

    from kvstrata.core.sampling_params import GrammarSpec

    params = greedy(max_tokens=48, structured=GrammarSpec(*GRAMMARS[grammar]))
    plain = make_engine(enable_prefix_caching=False).generate([REPEATING], params)[0]
    engine = make_engine(speculative_config=NGRAM, **TIERS)
    engine.step_cost.draft_break_even = lambda decodes: 0.0    # drafts verified whether or not they pay here
    spec = engine.generate([REPEATING], params)[0]
    assert spec.new_token_ids == plain.new_token_ids and spec.text == plain.text
    stats = engine.stats
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if grammar == "regex" and spec.finish_reason == "stop":
        assert re.fullmatch(GRAMMARS["regex"][1], spec.text)
    elif grammar == "json" and spec.finish_reason == "stop":
        assert set(json.loads(spec.text)) >= {"name", "body"}
    assert engine.scheduler.tiers.audit()["device"].used == 0


def test_sampled_structured_output_with_drafts_obeys_its_grammar(make_engine):
    """Rejection sampling over masked rows: every sampled answer with drafts still matches the regex."""
    import re

    from kvstrata.core.sampling_params import GrammarSpec

    pattern = "[a-z ]{4,40}"
    engine = make_engine(speculative_config=NGRAM)
    engine.step_cost.draft_break_even = lambda decodes: 0.0
    params = SamplingParams(max_tokens=48, temperature=1.0, n=4, structured=GrammarSpec("regex", pattern))
    outputs = engine.generate([REPEATING], params)
    assert engine.stats.spec_decode_num_draft_tokens > 0
    for output in outputs:
        assert output.finish_reason == "stop" and re.fullmatch(pattern, output.text), output.text


def test_logprobs_of_accepted_drafts_are_those_of_plain_decoding(make_engine, smollm2):
    """fp32: every token's logprob, rank and top-3 with n-gram drafts equal plain decoding's, the
    accepted drafts' (scored from their verification rows) as much as the sampled tokens'."""
    params = greedy(logprobs=3)
    plain = make_engine(enable_prefix_caching=False).generate(prompts()[:3], params)
    engine = make_engine(speculative_config=NGRAM, **TIERS)
    engine.step_cost.draft_break_even = lambda decodes: 0.0    # drafts verified whether or not they pay here
    spec = engine.generate(prompts()[:3], params)
    assert engine.stats.spec_decode_num_accepted_tokens > 10        # many tokens came from drafts
    for got, want in zip(spec, plain):
        assert got.new_token_ids == want.new_token_ids
        assert len(got.logprobs) == len(want.logprobs) == len(got.new_token_ids)
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def test_families_speculate_once_forked_and_keep_plain_outputs(make_engine, reference):
    """n = 2 and best_of = 3 (ranked by cumulative logprob, which verification now scores):
    greedy samples equal plain decoding's output token for token."""
    expected = reference[1]["greedy"][0].new_token_ids
    engine = make_engine(speculative_config=NGRAM, **TIERS)
    outputs = engine.generate([REPEATING], greedy(n=2)) + engine.generate([REPEATING], greedy(best_of=3))
    assert [o.new_token_ids for o in outputs] == [expected] * 3
    assert engine.stats.spec_decode_num_accepted_tokens > 10


def test_a_failed_step_carrying_drafts_ends_its_requests_and_leaks_nothing(make_engine, reference):
    """The model step fails while a request verifies drafts beside another's decode: both end with
    an error, the books balance, the requests waiting behind them and a rerun of the failed prompt
    (which hits the prefix its blocks cached, never a draft's KV) decode exactly as plain decoding."""
    from kvstrata.kvcache.faults import FaultInjector

    faults = FaultInjector()
    engine = make_engine(faults=faults, speculative_config=NGRAM, max_num_seqs=2, **TIERS)
    expected = [o.new_token_ids for o in reference[1]["greedy"]]
    failed_steps = []
    schedule = engine.scheduler.schedule

    def arm_on_drafts(*args, **kwargs):
        """Arm the model-step fault for the first step whose drafting request has 5 tokens out."""
        output = schedule(*args, **kwargs)
        if not failed_steps and any(c.draft_token_ids and c.request.num_output_tokens >= 5 for c in output.chunks):
            failed_steps.append(output)
            faults.arm("execute")
        return output
    engine.scheduler.schedule = arm_on_drafts
    texts = prompts()
    requests = [engine.add_request(text, greedy()) for text in texts[:4]]    # two run, two wait (max_num_seqs)
    outputs = {r.request_id: [] for r in requests}
    finishes = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finishes[out.request_id] = out.finish_reason
    assert faults.raised["execute"] == 1 and len(failed_steps) == 1, "no step with drafts met the fault"
    failed = {c.request.request_id for c in failed_steps[0].chunks}
    assert requests[0].request_id in failed and len(failed) == 2          # the drafting request and another
    for index, request in enumerate(requests):
        if request.request_id in failed:
            assert finishes[request.request_id] == "error"
        else:                                           # it waited behind the failed step: unchanged
            assert outputs[request.request_id] == expected[index]
            assert finishes[request.request_id] == reference[1]["greedy"][index].finish_reason
    engine.scheduler.audit()
    assert_nothing_held(engine)
    rerun = engine.generate(texts[:2], greedy())
    assert [o.new_token_ids for o in rerun] == expected[:2] and rerun[0].num_cached_tokens > 0
    assert engine.stats.step_failures == 1 and engine.stats.spec_decode_num_drafts > 0
    assert_nothing_held(engine)


def assert_nothing_held(engine) -> None:
    for tier, counts in engine.tiers.audit().items():
        assert counts.used == 0 and counts.in_flight == 0, f"{tier}: {counts}"
