"""What evaluation harnesses and vLLM users send, through the official `openai` client: echo with
logprobs (exact against transformers' log-softmax, with every cache tier and after a prefix hit),
batched prompts, logit_bias, allowed_token_ids, bad_words, the detokenizer's and the chat template's
options, and fields nobody defines (accepted, logged)."""

from __future__ import annotations

import logging
import math

import httpx
import openai
import pytest
import torch

from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, wait_idle

TOLERANCE = 1e-4       # fp32 engine against fp32 transformers, in nats
PROMPTS = ["The capital of France is Paris. The capital of Italy is",
           "The capital of France is Paris. The capital of Spain is",
           "Water boils at one hundred degrees"]


@pytest.fixture(scope="module")
def reference(smollm2_fp32):
    """log_softmax(logits) of transformers' own Llama on the same weights, per prompt position."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_fp32.folder, dtype=torch.float32).eval()

    def score(token_ids: list[int]) -> list[float]:
        with torch.no_grad():
            logprobs = model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
        return [logprobs[i, token_ids[i + 1]].item() for i in range(len(token_ids) - 1)]
    return score


@pytest.fixture(scope="module", params=["tiers", "no-cache"])
def server(request, smollm2_fp32, tmp_path_factory):
    """Every cache feature on (prefix caching, host tier, disk store), or prefix caching off."""
    options = ({"host_cache_memory": "32MiB", "store": "disk", "store_path": str(tmp_path_factory.mktemp("store"))}
               if request.param == "tiers" else {"enable_prefix_caching": False})
    with running_server(smollm2_fp32, num_device_blocks=256, block_size=16, **options) as (base, engine):
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused")


def at_rest(server) -> None:
    base, engine = server
    wait_idle(engine)
    assert blocks_at_rest(base)["used"] == 0


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_are_the_models_log_softmax(server, client, reference, max_tokens):
    """lm-eval's loglikelihood request: echo + logprobs, max_tokens 0 or 1, text and token-id prompts;
    the second round comes after those prompts' blocks were cached (a hit is never taken for them)."""
    for _ in range(2):
        for text in PROMPTS:
            ids = tokenize(server, text)
            for prompt in (text, ids):
                reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, echo=True,
                                                  logprobs=1, temperature=0)
                choice = reply.choices[0]
                scored = choice.logprobs.token_logprobs[:len(ids)]
                assert scored[0] is None and len(choice.logprobs.tokens) == len(ids) + max_tokens
                assert max(abs(a - b) for a, b in zip(scored[1:], reference(ids))) < TOLERANCE
                assert choice.text.startswith(text) and (max_tokens or choice.text == text)
                assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == max_tokens
                assert choice.logprobs.text_offset[0] == 0 and choice.logprobs.top_logprobs[0] is None
    at_rest(server)


def tokenize(server, text: str) -> list[int]:
    return httpx.post(f"{server[0]}/tokenize", json={"prompt": text}).json()["tokens"]


def test_prompt_logprobs_field_has_ranks(client, reference):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    scored = reply.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and all(len(entry) >= 2 for entry in scored[1:])
    for entry in scored[1:]:
        ranks = sorted(item["rank"] for item in entry.values())
        assert ranks[0] == 1 and all(math.isfinite(item["logprob"]) for item in entry.values())


def test_batched_prompts_one_choice_per_prompt_in_order(server, client):
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in PROMPTS]
    together = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2] and [c.text for c in together.choices] == alone
    assert together.usage.completion_tokens == 18
    doubled = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=3, n=2, temperature=0.8, seed=3)
    assert sorted(c.index for c in doubled.choices) == [0, 1, 2, 3]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == alone and chunks[-1].usage.completion_tokens == 18
    at_rest(server)


def test_echo_streams_the_prompt_first(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(PROMPTS[2]) and chunks[0].logprobs.token_logprobs[0] is None
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0, echo=True)
    assert "".join(c.text for c in chunks) == whole.choices[0].text


def greedy_first_token(client, prompt: str) -> int:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=0,
                                      extra_body={"return_tokens_as_token_ids": True})
    return int(reply.choices[0].logprobs.tokens[0].removeprefix("token_id:"))


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_minus_100_bans_the_greedy_token(client, stream):
    banned = greedy_first_token(client, PROMPTS[0])
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, logprobs=1,
                                      logit_bias={str(banned): -100}, stream=stream,
                                      extra_body={"return_tokens_as_token_ids": True})
    choice = next(iter(reply)).choices[0] if stream else reply.choices[0]
    assert int(choice.logprobs.tokens[0].removeprefix("token_id:")) != banned
    # the logprobs are the model's raw ones: the banned token is still its top choice
    assert choice.logprobs.top_logprobs[0] == {f"token_id:{banned}": pytest.approx(
        max(choice.logprobs.top_logprobs[0].values()))}


def test_allowed_token_ids_restrict_every_token(client):
    allowed = [greedy_first_token(client, p) for p in PROMPTS]
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=1,
                                      logprobs=0, extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                                              "return_tokens_as_token_ids": True})
    assert {int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens} <= set(allowed)


def test_bad_words_never_appear(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text
    word = plain.split()[0]
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                      extra_body={"bad_words": [word]})
    assert word not in reply.choices[0].text.split() and reply.choices[0].text != plain


def test_detokenizer_and_truncation_options(client):
    prompt = "Say yes. Answer:"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    stop = plain.strip().split()[0]
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True}).choices[0].text
    assert kept.endswith(stop) and kept == plain[:plain.index(stop) + len(stop)]
    truncated = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert truncated.usage.prompt_tokens == 4
    special = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=40, temperature=0,
        extra_body={"skip_special_tokens": False, "ignore_eos": True, "stop_token_ids": []})
    assert "<|im_end|>" in special.choices[0].message.content


def test_chat_template_options(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    go_on = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                       "echo": True})
    content = go_on.choices[0].message.content
    assert content.startswith("The capital of France is") and "Paris" in content
    custom = client.chat.completions.create(
        model=MODEL, messages=messages[:1], max_tokens=1, temperature=0,
        extra_body={"chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{{ greeting }}",
                    "chat_template_kwargs": {"greeting": "Answer:"}})
    plain = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1, temperature=0)
    rendered = tokenize(server, "What is the capital of France?\nAnswer:")
    assert custom.usage.prompt_tokens == len(rendered) != plain.usage.prompt_tokens


def test_unknown_fields_are_accepted_and_named_in_the_log(server, client, caplog):
    with caplog.at_level(logging.WARNING, logger="kvstrata.entrypoints.openai.serving"):
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                          extra_body={"my_client_tag": "x", "stream_options_extra": 1})
    assert reply.choices[0].finish_reason == "length"
    assert any("my_client_tag, stream_options_extra" in r.getMessage() for r in caplog.records)
    refused = pytest.raises(openai.BadRequestError, client.completions.create, model=MODEL, prompt="Hi",
                            extra_body={"suffix": "x"})
    assert refused.value.body["param"] == "suffix"
    at_rest(server)


def test_chat_echo_and_constraints_stream_as_they_answer_whole(client):
    """The streamed reply joins to the whole one, echo and processors included."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "A colour:"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True,
             "bad_words": ["red"], "logit_bias": {"29": -100}, "ignore_eos": True}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=extra).choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body=extra, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole and whole.startswith("A colour:") and "red" not in whole[len("A colour:"):]
