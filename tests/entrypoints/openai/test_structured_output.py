"""Structured output and tool calls through the official `openai` client, against one live server."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, wait_idle

# Nested object, enum, array; sizes bounded so that every answer ends well within max_tokens.
PLACE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["city", "river", "mountain"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "where": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 10},
                                                   "lat": {"type": "integer", "minimum": -90, "maximum": 90}},
                  "required": ["country", "lat"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "where"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Describe Paris as a JSON object."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, num_device_blocks=256, block_size=16, max_num_seqs=32) as (base, engine):
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused")


def _at_rest(server) -> None:
    base, engine = server
    wait_idle(engine)
    assert blocks_at_rest(base)["used"] == 0


def _sampled(client, count: int, messages=ASK, **kwargs) -> list:
    """`count` answers at temperature 1, sent at once (one batch), seeded so a failure reproduces."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: client.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, seed=i, **kwargs).choices[0], range(count)))


def test_json_schema_answers_validate(client, server):
    schema_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    choices = _sampled(client, 20, max_tokens=96, response_format=schema_format)
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PLACE)
    assert len({c.message.content for c in choices}) > 1          # sampled, not one answer twenty times
    _at_rest(server)


def test_json_object_answers_parse(client, server):
    # Any object may nest without end; asking for a small one lets a 135M model end within max_tokens.
    short = [{"role": "user", "content": 'Give the capital of France as a small JSON object, like {"capital": "Rome"}.'}]
    choices = _sampled(client, 20, short, max_tokens=128, response_format={"type": "json_object"})
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)
    _at_rest(server)


def test_seeded_constrained_answer_reproduces(client):
    kwargs = dict(model=MODEL, messages=ASK, temperature=1.0, seed=11, max_tokens=64,
                  extra_body={"guided_json": PLACE})
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first
    jsonschema.validate(json.loads(first), PLACE)


def test_regex_and_choice_are_obeyed(client):
    pattern = r"[0-9]{2}-[a-z]{3}"
    for seed in range(3):
        text = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=seed,
                                              extra_body={"guided_regex": pattern}).choices[0].message.content
        assert re.fullmatch(pattern, text), text
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is it sunny or rainy in Paris?"}], max_tokens=8,
        temperature=1.0, seed=3, extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}}).choices[0]
    assert choice.message.content in ("sunny", "rainy") and choice.finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=1.0,
                                           extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert completion.text in ("yes", "no")


def test_greedy_logprobs_are_the_raw_models(client):
    """The mask changes what may be picked, not what the model is said to think (vLLM's raw logprobs)."""
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    free = client.chat.completions.create(**kwargs).choices[0]
    held = client.chat.completions.create(extra_body={"guided_regex": "[0-9]{6}"}, **kwargs).choices[0]
    assert re.fullmatch("[0-9]{6}", held.message.content) and not re.fullmatch("[0-9]{6}", free.message.content)
    model_view = [(t.token, round(t.logprob, 4)) for t in free.logprobs.content[0].top_logprobs]
    assert [(t.token, round(t.logprob, 4)) for t in held.logprobs.content[0].top_logprobs] == model_view
    assert held.logprobs.content[0].logprob < model_view[0][1]     # it picked a digit the model did not favour


def test_constrained_answer_cut_by_max_tokens_ends_with_length(client):
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}).choices[0]
    assert choice.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


@pytest.mark.parametrize("extra, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "Invalid type: strin"),
    ({"extra_body": {"guided_regex": "(ab"}}, "unclosed group"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nowhere"}}}, "unknown name"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}}, "one constraint"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structural_tag not supported"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "constrains"),
])
def test_rejected_grammar_is_400_and_nothing_is_held(client, server, extra, fragment):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **extra)
    assert fragment in caught.value.body["message"] and caught.value.body["param"]
    base, engine = server
    assert not engine.has_unfinished and engine.scheduler.num_waiting == 0
    _at_rest(server)


def test_required_tool_call_parses_into_arguments(client, server):
    choice = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", max_tokens=64, temperature=0).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id.startswith("call_") and call.type == "function"
    _at_rest(server)


def test_named_tool_call_streams_argument_deltas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                            tool_choice=named, max_tokens=48, temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert len(calls) > 1                                   # arguments arrive in pieces
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    arguments = "".join(c.function.arguments for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert deltas[-1].finish_reason == "tool_calls"
    whole = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                           tool_choice=named, max_tokens=48, temperature=0).choices[0]
    assert whole.message.tool_calls[0].function.arguments == arguments


def test_required_tool_calls_stream_whole(client):
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                            temperature=0, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [call for d in deltas for call in d.delta.tool_calls or ()]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert deltas[-1].finish_reason == "tool_calls"
    assert not any(d.delta.content for d in deltas)


def test_samples_of_one_request_each_follow_the_grammar_and_call_tools(client, server):
    """n > 1 with a schema and with a named tool: every sample has its own matcher and its own
    tool-call parser (streamed, each index assembles its own arguments)."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, n=3, temperature=1.0, seed=5, max_tokens=96,
                                           response_format=schema_format)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), PLACE)
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model=MODEL, messages=WEATHER_ASK, tools=[WEATHER], tool_choice=named,
                                            n=2, temperature=1.0, seed=3, max_tokens=48, stream=True)
    arguments, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                arguments[choice.index] += call.function.arguments or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for text in arguments.values():
        jsonschema.validate(json.loads(text), WEATHER["function"]["parameters"])
    _at_rest(server)


def test_conversation_with_a_tool_result_is_accepted(client, server):
    turns = WEATHER_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=turns, tools=[WEATHER], max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    prompt = server[1].tokenizer.decode(server[1].chat_prompt(turns, [WEATHER]))
    assert '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in prompt and "<tools>" in prompt
    bad = httpx.post(f"{server[0]}/v1/chat/completions", json={"messages": turns[:2] + [
        {"role": "tool", "content": "21"}]})
    assert bad.status_code == 400 and "tool_call_id" in bad.json()["error"]["message"]


def test_unconstrained_requests_in_a_constrained_batch_are_unaffected(client, server):
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]

    def greedy(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    alone = [greedy(p) for p in prompts]
    schema_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(client.chat.completions.create, model=MODEL, messages=ASK, temperature=1.0,
                                   seed=i, max_tokens=48, response_format=schema_format) for i in range(3)]
        mixed = list(pool.map(greedy, prompts))
        for future in constrained:
            jsonschema.validate(json.loads(future.result().choices[0].message.content), PLACE)
    assert mixed == alone
    _at_rest(server)
