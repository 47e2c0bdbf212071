"""Grammar specs, the sampler's masks, and tool-call parsing and rendering, without a server."""

import json

import jsonschema
import pytest
import torch

from kvstrata.core.errors import RequestRejected
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import Request
from kvstrata.core.sampling_params import GrammarSpec, SamplingParams
from kvstrata.structured.grammar import GrammarMasker, compile_grammar, spec_from_request, token_bound
from kvstrata.structured.tool_calls import ToolCallStream, ToolPlan, inline_tools, message
from kvstrata.worker.sampler import Sampler

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NO_GUIDED = {"guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None}


# ---- specs ------------------------------------------------------------------------------------------
def test_each_api_form_gives_its_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_format = spec_from_request({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, None,
                                  NO_GUIDED)
    assert by_format == GrammarSpec("json_schema", json.dumps(schema), "response_format")
    assert spec_from_request({"type": "text"}, None, NO_GUIDED) is None
    assert spec_from_request({"type": "json_object"}, None, NO_GUIDED).kind == "json_object"
    assert spec_from_request(None, {"json": schema}, NO_GUIDED).source == by_format.source
    assert spec_from_request(None, {"regex": "a+"}, NO_GUIDED) == GrammarSpec("regex", "a+", "structured_outputs")
    assert spec_from_request(None, None, {**NO_GUIDED, "guided_json": json.dumps(schema)}).source == by_format.source
    assert spec_from_request(None, None, {**NO_GUIDED, "guided_choice": ["x", "y"]}).kind == "choice"


@pytest.mark.parametrize("response_format, options, guided, param", [
    ({"type": "json_schema"}, None, {}, "response_format"),
    ({"type": "xml"}, None, {}, "response_format"),
    (None, {"regex": "a", "choice": ["b"]}, {}, "structured_outputs"),
    (None, {"whitespace_pattern": " "}, {}, "structured_outputs"),
    (None, None, {"guided_choice": []}, "guided_choice"),
    (None, None, {"guided_json": "{nope"}, "guided_json"),
    ({"type": "json_object"}, {"regex": "a"}, {}, "structured_outputs"),
])
def test_malformed_or_several_constraints_are_refused(response_format, options, guided, param):
    with pytest.raises(RequestRejected) as caught:
        spec_from_request(response_format, options, {**NO_GUIDED, **guided})
    assert caught.value.param == param


def test_a_grammar_the_library_rejects_is_refused():
    bad = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, "response_format")
    with pytest.raises(RequestRejected, match="Invalid type: strin") as caught:
        compile_grammar(bad)
    assert caught.value.param == "response_format"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured=GrammarSpec("regex", "a+"), min_tokens=2).validate()


def test_token_bound_reads_bit_t_of_word_t_over_32():
    bitmask = torch.tensor([[0b101, -(1 << 31)], [0, -1]], dtype=torch.int32)
    bound = token_bound(bitmask, 63)
    assert bound.shape == (2, 63) and set(bound.flatten().tolist()) == {float("inf"), float("-inf")}
    allowed = bound > 0
    assert allowed[0].nonzero()[0].tolist() == [0, 2]                      # token 63 is past the vocabulary
    assert allowed[1].nonzero()[0].tolist() == list(range(32, 63))


# ---- the sampler -------------------------------------------------------------------------------------
def _request(smollm2, rid: str, params: SamplingParams, output: list[int] = ()) -> Request:
    request = Request(rid, [1, 2, 3], params, BlockHasher.create(16, "m"))
    for token in output:
        request.append_output(token)
    return request


def _sampler(smollm2) -> Sampler:
    masker = GrammarMasker(smollm2.tokenizer, smollm2.arch.vocab_size, smollm2.eos_token_ids)
    return Sampler(smollm2.eos_token_ids, seed=0, grammars=masker)


def test_mask_holds_constrained_rows_only_and_leaves_raw_logprobs(smollm2):
    vocab = smollm2.arch.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    digits = SamplingParams(max_tokens=8, temperature=0, logprobs=2, structured=GrammarSpec("regex", "[0-9]+"))
    free = [SamplingParams(max_tokens=8, temperature=0, logprobs=2),
            SamplingParams(max_tokens=8, temperature=0.8, seed=5)]
    mixed = [_request(smollm2, "f0", free[0]), _request(smollm2, "c0", digits),
             _request(smollm2, "f1", free[1]), _request(smollm2, "c1", digits)]
    out = _sampler(smollm2)(logits.clone(), mixed)
    alone = _sampler(smollm2)(logits[[0, 2]].clone(), [_request(smollm2, "f0", free[0]),
                                                        _request(smollm2, "f1", free[1])])
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids
    assert out.logprobs[0] == alone.logprobs[0]
    for row in (1, 3):
        assert smollm2.tokenizer.decode([out.token_ids[row]]).isdigit()
        raw = logits[row].log_softmax(-1)
        assert out.logprobs[row].logprob == pytest.approx(raw[out.token_ids[row]].item(), abs=1e-5)
        assert out.logprobs[row].top[0][0] == raw.argmax().item()        # the model's view, not the mask's


def test_matcher_follows_the_ledger_and_only_eos_ends_a_finished_grammar(smollm2):
    sampler = _sampler(smollm2)
    tokenizer = smollm2.tokenizer
    params = SamplingParams(max_tokens=8, temperature=0, structured=GrammarSpec.choice(["yes", "no"], "guided_choice"))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    request = _request(smollm2, "r", params, yes)          # the matcher has not seen these tokens yet
    logits = torch.zeros(1, smollm2.arch.vocab_size)
    logits[0, 0] = 5.0                                       # the model wants token 0, which the grammar forbids
    assert sampler(logits, [request]).token_ids == [smollm2.eos_token_ids[0]]


def test_unconstrained_batch_keeps_the_raw_logits(smollm2):
    logits = torch.randn(2, smollm2.arch.vocab_size)
    requests = [_request(smollm2, f"r{i}", SamplingParams(temperature=0)) for i in range(2)]
    masker = _sampler(smollm2).grammars
    assert masker.mask(logits, requests, in_place=False) is logits


# ---- tools -------------------------------------------------------------------------------------------
def _plan(choice="auto", parallel=None, tools=(WEATHER, TIME)) -> ToolPlan:
    return ToolPlan.from_request(list(tools), choice, parallel)


@pytest.mark.parametrize("text, names", [
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>', ["get_weather"]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', ["get_weather"]),
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
     '<tool_call>{"name": "get_time", "parameters": {}}</tool_call>', ["get_weather", "get_time"]),
    ('<tool_call>[{"name": "get_time", "arguments": {}}]', ["get_time"]),                # tag never closed
    ('<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>', []),                # not a tool
    ('<tool_call>[{"name": "get_time", "arguments": {</tool_call>', []),                 # broken JSON
    ("Oslo is sunny.", []),
])
def test_auto_parses_the_trained_call_formats(text, names):
    content, calls = _plan().calls(text)
    assert [c["function"]["name"] for c in calls] == names
    assert (content is None) == bool(names)
    for call in calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict) and call["id"].startswith("call_")


def test_message_and_finish_reason():
    reply, finish = message(_plan(), 'Sure.\n<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>', "stop")
    assert finish == "tool_calls" and reply["content"] == "Sure." and reply["tool_calls"][0]["function"]["name"] == "get_time"
    assert message(_plan(), "No tools needed.", "stop") == ({"role": "assistant", "content": "No tools needed."}, "stop")
    assert message(_plan("none"), '<tool_call>[]</tool_call>', "stop")[0]["content"] == '<tool_call>[]</tool_call>'
    one = _plan(parallel=False).calls('<tool_call>[{"name": "get_time", "arguments": {}}, '
                                      '{"name": "get_weather", "arguments": {"city": "x"}}]</tool_call>')[1]
    assert [c["function"]["name"] for c in one] == ["get_time"]


def test_auto_stream_sends_content_until_a_tag_may_start():
    stream = ToolCallStream(_plan())
    pieces = ["Let me ", "check. <", "tool_", 'call>[{"name": "get_time", ', '"arguments": {}}]</tool_call>']
    deltas = [stream.delta(p, None) for p in pieces] + [stream.delta("", "stop")]
    sent = "".join(d.get("content", "") for d, _ in deltas[:-1])
    assert sent == "Let me check. "                         # "<" was held: it could open a tag
    last, finish = deltas[-1]
    assert finish == "tool_calls" and last["tool_calls"][0]["function"]["name"] == "get_time"
    assert last["tool_calls"][0]["index"] == 0 and "content" not in last
    plain = ToolCallStream(_plan())
    texts = [plain.delta("a < b", None), plain.delta(" indeed", "stop")]
    assert "".join(d.get("content", "") for d, _ in texts) == "a < b indeed" and texts[-1][1] == "stop"


def test_required_and_named_constraints_describe_the_tools():
    required = json.loads(_plan("required", parallel=False).constraint().source)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, required)       # parallel off: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], required)        # city is required
    named = _plan({"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint().source) == WEATHER["function"]["parameters"]
    assert [t["function"]["name"] for t in named.prompt_tools] == ["get_weather"]
    assert _plan("auto").constraint() is None and _plan("none").prompt_tools == []


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function"}], "auto", "tools"),
    ([WEATHER, WEATHER], "auto", "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_malformed_tools_are_refused(tools, choice, param):
    with pytest.raises(RequestRejected) as caught:
        ToolPlan.from_request(tools, choice, None)
    assert caught.value.param == param


def test_inline_tools_writes_the_trained_format():
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
             {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    rendered = inline_tools(turns, [WEATHER])
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert "<tools>" in rendered[0]["content"] and rendered[0]["content"].endswith("Be brief.")
    assert rendered[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    assert rendered[3]["content"] == "<tool_response>\nsunny\n</tool_response>"


def test_a_failed_grammar_ends_its_answer_alone(smollm2):
    """A matcher in error (here: fed a token its grammar forbids) lets only EOS through for its row."""
    sampler = _sampler(smollm2)
    params = SamplingParams(max_tokens=8, temperature=0, structured=GrammarSpec("regex", "[0-9]+"))
    letters = smollm2.tokenizer.encode("abc", add_special_tokens=False)
    broken = _request(smollm2, "broken", params, letters)
    fine = _request(smollm2, "fine", params)
    out = sampler(torch.randn(2, smollm2.arch.vocab_size), [broken, fine])
    assert out.token_ids[0] == smollm2.eos_token_ids[0]
    assert smollm2.tokenizer.decode([out.token_ids[1]]).isdigit()


def test_parallel_fill_gives_the_masks_of_the_one_by_one_fill(smollm2):
    specs = [GrammarSpec("regex", "[0-9]+"), GrammarSpec.choice(["yes", "no"], "c"), GrammarSpec("json_object", "")]
    requests = [_request(smollm2, f"r{i}", SamplingParams(temperature=0, structured=spec))
                for i, spec in enumerate(specs)]
    logits = torch.randn(3, smollm2.arch.vocab_size)
    masks = []
    for parallel_from in (128, 2):
        masker = GrammarMasker(smollm2.tokenizer, smollm2.arch.vocab_size, smollm2.eos_token_ids,
                               parallel_from=parallel_from)
        masks.append(masker.mask(logits, requests, in_place=False) > float("-inf"))
    assert torch.equal(masks[0], masks[1]) and 0 < int(masks[0].sum()) < masks[0].numel()
