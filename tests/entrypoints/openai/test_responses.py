"""OpenAI's Responses API (/v1/responses) with the official `openai` client, against a live server."""

import itertools
import json

import httpx
import openai
import pytest

from kvstrata.core.outputs import RequestOutput
from kvstrata.entrypoints.openai.responses.events import ResponseEvents
from kvstrata.entrypoints.openai.responses.protocol import ResponsesRequest
from kvstrata.entrypoints.openai.responses.store import ResponseStore, StoredResponse
from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, scrape, wait_idle

BLOCK = 16
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, num_device_blocks=256, block_size=BLOCK) as (base, engine):
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused")


def _tokens(base: str, messages: list[dict]) -> int:
    return httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["count"]


def test_create(client):
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                    metadata={"test": "create"})
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.status == "completed"
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and "Paris" in reply.output_text
    usage = reply.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (reply.model, reply.temperature, reply.top_p, reply.max_output_tokens) == (MODEL, 0.0, 1.0, 24)
    assert reply.store and reply.truncation == "disabled" and reply.metadata == {"test": "create"}
    assert reply.text.format.type == "text" and reply.tools == [] and reply.tool_choice == "auto"


def test_cut_short_is_incomplete(client):
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 2 and reply.output[0].status == "incomplete"


def test_stream(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text and "Paris" in text
    done, completed = events[-4], events[-1].response
    assert done.text == text and completed.output_text == text and completed.status == "completed"
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas)
    assert completed.output[0].id == item_id and completed.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(completed.id).output_text == text


def test_instructions_are_a_system_message_not_carried_over(server, client):
    base, _ = server
    instructions = "You are a geography teacher."
    first = client.responses.create(model=MODEL, input=QUESTION, instructions=instructions, max_output_tokens=16,
                                    temperature=0)
    assert first.instructions == instructions
    conversation = [{"role": "user", "content": QUESTION}]
    assert first.usage.input_tokens == _tokens(base, [{"role": "system", "content": instructions}, *conversation])
    second = client.responses.create(model=MODEL, input="And of Spain?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert second.instructions is None and second.previous_response_id == first.id
    conversation += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Spain?"}]
    assert second.usage.input_tokens == _tokens(base, conversation)


def test_five_turns_hit_the_prefix_cache(client):
    questions = [QUESTION, "And the capital of Germany?", "And of Italy?", "And of Spain?", "Which is the largest?"]
    figures, previous = [], None
    for question in questions:
        reply = client.responses.create(model=MODEL, input=question, previous_response_id=previous,
                                        instructions="Answer in one short sentence.", max_output_tokens=24,
                                        temperature=0)
        usage = reply.usage
        figures.append((usage.input_tokens, usage.input_tokens_details.cached_tokens, usage.output_tokens))
        previous = reply.id
    print("\n(input_tokens, cached_tokens, output_tokens) per turn:", figures)
    for (prompt, _, output), (next_prompt, cached, _) in itertools.pairwise(figures):
        # Everything the last turn computed (its prompt, its reply but the last token), in whole blocks.
        assert cached == (prompt + output - 1) // BLOCK * BLOCK
        assert cached >= next_prompt - 2 * BLOCK - 24        # all but the new question's blocks
    assert [cached for _, cached, _ in figures] == sorted(cached for _, cached, _ in figures)
    assert all(cached / prompt > 0.6 for prompt, cached, _ in figures[2:])


def test_function_call_and_its_output(client):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.responses.create(model=MODEL, input=asked, tools=[WEATHER], tool_choice="required",
                                     max_output_tokens=40, temperature=0)
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] and called.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'}
    chained = client.responses.create(model=MODEL, input=[result], previous_response_id=called.id, tools=[WEATHER],
                                      max_output_tokens=16, temperature=0)
    assert chained.status in ("completed", "incomplete") and chained.output
    assert chained.usage.input_tokens_details.cached_tokens >= BLOCK     # the tools' system prompt at least
    # The same conversation sent whole, the client's own output items passed back, renders the same prompt.
    whole = client.responses.create(model=MODEL, input=[*asked, *[item.model_dump() for item in called.output],
                                                        result], tools=[WEATHER], max_output_tokens=16,
                                    temperature=0)
    assert whole.usage.input_tokens == chained.usage.input_tokens
    assert whole.output_text == chained.output_text


def test_named_function_streams_its_arguments(client):
    events = list(client.responses.create(model=MODEL, input="What is the weather in Rome?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == arguments
    assert events[-3].arguments == arguments and json.loads(arguments)["city"]


def test_retrieve_and_delete(client):
    reply = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    again = client.responses.retrieve(reply.id)
    assert again.id == reply.id and again.output_text == reply.output_text and again.usage == reply.usage
    assert client.responses.delete(reply.id) is None
    for call in (lambda: client.responses.retrieve(reply.id), lambda: client.responses.delete(reply.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as error:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=reply.id, max_output_tokens=2)
    assert error.value.param == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("fields, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": "word " * 9000}, "input"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
])
def test_refused_fields_name_the_param(server, client, fields, param):
    rejected = f'kvstrata_requests_finished_total{{model_name="{MODEL}",outcome="rejected"}}'
    before = scrape(server[0]).get(rejected, 0)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 2, **fields})
    assert error.value.param == param
    assert scrape(server[0])[rejected] == before + 1


def test_structured_text_format(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert reply.status == "completed" and set(json.loads(reply.output_text)) == {"capital"}


def test_disconnect_aborts_and_nothing_is_held(server):
    base, engine = server
    before = scrape(base)
    with httpx.stream("POST", f"{base}/v1/responses", json={"model": MODEL, "input": "Tell me a long story.",
                                                            "max_output_tokens": 500, "stream": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: response.created"
        for line in lines:
            if line.startswith("event: response.output_text.delta"):
                break
    wait_idle(engine)
    after = scrape(base)
    key = f'kvstrata_requests_finished_total{{model_name="{MODEL}",outcome="abort"}}'
    assert after[key] == before.get(key, 0) + 1
    blocks = blocks_at_rest(base)
    assert blocks["used"] == 0 and blocks["in_flight"] == 0


def test_store_keeps_the_most_recent():
    store = ResponseStore(capacity=2)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse({"id": name}, ()))
    assert store.get("a") is None and len(store) == 2
    store.get("b")                       # b is now the most recent: c goes first
    store.put("d", StoredResponse({"id": "d"}, ()))
    assert store.get("c") is None and store.get("b") is not None
    assert store.delete("b") and not store.delete("b")


def _out(text: str, finish: str | None = None) -> RequestOutput:
    return RequestOutput("resp_x", [1], text, finish is not None, finish, 10, 0, 1)


def test_events_of_text_then_an_auto_call():
    """Text streams as it comes; a call under "auto" arrives whole at the end, as the message's successor."""
    tools = ResponsesRequest(input="", tools=[WEATHER]).tool_plan()
    events = ResponseEvents(tools)
    pieces = ["Let me look. ", '<tool_call>[{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}]</tool_call>']
    sent = [e for i, piece in enumerate(pieces) for e in events.step(_out(piece, "stop" if i == 2 else None))]
    sent += events.finish("completed")
    data = [json.loads(e.split("data: ", 1)[1]) for e in sent]
    assert [d["type"] for d in data] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["output_index"] for d in data] == [0] * 6 + [1] * 4
    message, call = events.output
    assert message["content"][0]["text"] == "Let me look. " and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Oslo"},
                                                                            "completed")
