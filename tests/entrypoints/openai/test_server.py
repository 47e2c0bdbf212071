"""The HTTP API with the official `openai` client and raw httpx, against a live server."""

import asyncio
import json
import random

import httpx
import openai
import pytest

from kvstrata.model import kernels
from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, scrape, wait_idle


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, num_device_blocks=256, block_size=16) as (base, engine):
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused")


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_chat_completion(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.total_tokens == (
        reply.usage.prompt_tokens + reply.usage.completion_tokens)


def test_completion_and_cached_tokens(client):
    prompt = "A long shared preamble about rivers and mountains and the sea. " * 4 + "Tell me"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == whole


def test_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
    completion = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=1)
    assert len(completion.choices[0].logprobs.tokens) == 3


def test_stop_and_seed(client):
    kwargs = dict(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0.8)
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    assert a == b
    stopped = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0,
                                        stop=[" 6"])
    assert stopped.choices[0].finish_reason == "stop" and " 6" not in stopped.choices[0].text


def test_models_health_metrics(server):
    base, _ = server
    card = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert card["id"] == MODEL
    # what runs: the shared test model is `make serve`'s, the file at its bits, its layers in one C++ call
    assert card["runs"] == {"quantization": "gguf", "dtype": "bfloat16", "kv_cache_dtype": "bfloat16",
                            "step": "the decoder layers in one C++ call", "kernels": kernels.level().label}
    assert httpx.get(f"{base}/health").json() == {"status": "ok", "disaggregation_mode": "both"}
    assert "kvstrata_kv_blocks" in httpx.get(f"{base}/metrics").text


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=2)


BAD_INPUTS = [
    # (path, body (bytes or json), status, error type, message fragment)
    ("/v1/completions", b"{not json", 400, "invalid_request_error", "not valid JSON"),
    ("/v1/completions", b"\xff\xfe\x00garbage", 400, "invalid_request_error", "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "not_found_error", "does not exist"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "invalid_request_error", "at most"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "invalid_request_error", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "invalid_request_error", "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400, "invalid_request_error", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "invalid_request_error",
     "best_of must be between n (3)"),
    ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, 400, "invalid_request_error",
     "best_of greater than n cannot be streamed"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "invalid_request_error", "n: Input should be less"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "invalid_request_error", "'suffix' is not supported"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "invalid_request_error", "token ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "invalid_request_error", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "invalid_request_error",
     "token ids must be in"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "invalid_request_error",
     "allowed_token_ids"),
    ("/v1/completions", {"prompt": ""}, 400, "invalid_request_error", "must not be empty"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "invalid_request_error", "must not be empty"),
    ("/v1/completions", {"prompt": [[5, 6], [10**7]]}, 400, "invalid_request_error", "token ids must be in"),
    ("/v1/completions", {"prompt": ["a", [5]]}, 400, "invalid_request_error", "prompt"),
    ("/v1/completions", {"prompt": [10**7]}, 400, "invalid_request_error", "token ids must be in"),
    ("/v1/completions", {"prompt": [-1], "echo": True}, 400, "invalid_request_error", "token ids must be in"),
    ("/v1/completions", {"prompt": "word " * 9000}, 400, "invalid_request_error", "at most"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "invalid_request_error", "stop"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "invalid_request_error", "stream_options"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request_error",
     "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "invalid_request_error", "each tool must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "invalid_request_error", "only text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "invalid_request_error", "requires logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                              "add_generation_prompt": False}, 400, "invalid_request_error", "assistant message"),
    ("/v1/embeddings", {"input": "x"}, 404, "not_found_error", "Not Found"),
]


@pytest.mark.parametrize("path, body, status, kind, fragment", BAD_INPUTS)
def test_bad_inputs_get_openai_errors(server, path, body, status, kind, fragment):
    base, engine = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{base}{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and fragment in error["message"]
    wait_idle(engine)
    assert blocks_at_rest(base)["used"] == 0


def test_api_key_required(smollm2):
    with running_server(smollm2, api_key="sesame") as (base, _):
        assert httpx.get(f"{base}/v1/models").status_code == 401
        wrong = httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer sesame"}).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200


def test_full_queue_answers_503(smollm2):
    with running_server(smollm2, max_queue=1) as (base, engine):
        async def main():
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                body = {"prompt": "Tell me a story", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
                long = asyncio.create_task(http.post("/v1/completions", json=body))
                while not engine.has_unfinished:
                    await asyncio.sleep(0.01)
                refused = await http.post("/v1/completions", json={**body, "max_tokens": 2})
                return refused, await long
        refused, ok = asyncio.run(main())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_overloaded"
        assert ok.status_code == 200


def test_concurrent_streams_with_disconnects_leak_nothing(server):
    """32 streaming clients, a quarter of which hang up mid-stream; the rest get exactly the
    greedy answer, and at rest no block is used or in flight."""
    base, engine = server
    rng = random.Random(5)
    prompts = [f"Question {i % 8}: what is {i % 8} plus {i % 5}? Answer:" for i in range(32)]
    quitters = set(rng.sample(range(32), 8))
    body = dict(model=MODEL, max_tokens=16, temperature=0, ignore_eos=True)
    expected = {p: httpx.post(f"{base}/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                ["choices"][0]["text"] for p in set(prompts)}

    async def client(i, http):
        text = ""
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": prompts[i], "stream": True}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if i in quitters and len(text) >= rng.randrange(1, 10):
                    return None                      # leaving the context closes the connection
        return text

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            return await asyncio.gather(*(client(i, http) for i in range(32)))

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i not in quitters:
            assert text == expected[prompts[i]]
    wait_idle(engine)
    blocks = blocks_at_rest(base)
    assert blocks["used"] == 0 and blocks["in_flight"] == 0
    assert blocks["free"] + blocks["cached"] == engine.tiers.device.num_blocks
    metrics = scrape(base)
    assert metrics['kvstrata_requests_finished_total{model_name="SmolLM2-135M-Instruct",outcome="abort"}'] >= 1
    assert metrics["kvstrata_audit_failures_total"] == 0
    assert metrics['kvstrata_heap_bytes{kind="in_use"}'] > 0 and metrics["kvstrata_python_allocated_blocks"] > 0


def test_predicted_outputs_change_nothing_but_the_usage(client):
    chat = dict(model=MODEL, max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "Repeat this line exactly: the quick brown fox jumps over "
                                                      "the lazy dog, and the cat sleeps."}])
    plain = client.chat.completions.create(**chat)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None
    predicted = client.chat.completions.create(prediction={"type": "content", "content": text}, **chat)
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= predicted.usage.completion_tokens // 2
    wrong = client.chat.completions.create(prediction={"type": "content", "content": "Nothing like it at all."},
                                           stream=True, stream_options={"include_usage": True}, **chat)
    chunks = list(wrong)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens < details.accepted_prediction_tokens
    completion = dict(model=MODEL, prompt="Count: one, two, three, four,", max_tokens=12, temperature=0)
    expected = client.completions.create(**completion).choices[0].text
    again = client.completions.create(extra_body={"prediction": {"type": "content", "content": expected}}, **completion)
    assert again.choices[0].text == expected


def test_a_bad_prediction_is_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       prediction={"type": "audio", "content": "x"})
