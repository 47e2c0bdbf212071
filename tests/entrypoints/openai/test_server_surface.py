"""What users coming from vLLM reach for, through the real server: model retrieval, /tokenize,
/detokenize, /version, CORS, limits that tell the truth, error params naming the user's field,
the vLLM-style metrics, and one log line per request."""

import logging

import httpx
import openai
import pytest

from tests.entrypoints.server_helpers import MODEL, running_server, scrape

ORIGIN = "http://dashboard.example"


@pytest.fixture(scope="module")
def server(smollm2):
    with running_server(smollm2, num_device_blocks=256, block_size=16, allowed_origins=(ORIGIN,)) as served:
        yield served


def post(base, path, body, **kw):
    return httpx.post(f"{base}{path}", json=body, timeout=120, **kw)


def test_models_retrieve_and_version(server):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == 8192     # the model's own context
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    assert httpx.get(f"{base}/version").json()["version"]


def test_tokenize_counts_what_completions_count(server):
    base, _ = server
    prompt = "The quick brown fox jumps over the lazy dog."
    tokens = post(base, "/tokenize", {"prompt": prompt}).json()
    usage = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()["usage"]
    assert tokens["count"] == len(tokens["tokens"]) == usage["prompt_tokens"]
    assert tokens["max_model_len"] == 8192
    assert post(base, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": prompt}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post(base, "/tokenize", {"messages": messages}).json()
    reply = post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    bad = post(base, "/detokenize", {"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_cors_only_for_allowed_origins(server, smollm2):
    base, _ = server
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    answer = httpx.options(f"{base}/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{base}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    with running_server(smollm2, num_device_blocks=64) as (plain, _):        # off by default
        assert "access-control-allow-origin" not in httpx.get(f"{plain}/v1/models", headers={"Origin": ORIGIN}).headers


def test_completions_default_to_16_tokens(server):
    base, _ = server
    body = {"prompt": "Count: one, two, three,", "ignore_eos": True, "temperature": 0}
    assert post(base, "/v1/completions", body).json()["usage"]["completion_tokens"] == 16


def test_assistant_message_without_content(server):
    base, _ = server
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "What is 2 + 2?"}]
    assert post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}).status_code == 200


ERRORS = [
    # (path, body, param the user must change, fragment of the message)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages", "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     "temperature", "temperature"),
    ("/v1/completions", {"prompt": "word " * 9000}, "prompt", "at most 8192"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages", "at most"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8191}, "max_tokens", "lower max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8191},
     "max_completion_tokens", "lower max_tokens"),
]


@pytest.mark.parametrize("path, body, param, fragment", ERRORS)
def test_error_param_names_the_users_field(server, path, body, param, fragment):
    base, _ = server
    response = post(base, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_metrics_vllm_dashboards_use(server):
    base, _ = server
    label = f'model_name="{MODEL}"'
    before = scrape(base)
    rejected = f'kvstrata_requests_finished_total{{{label},outcome="rejected"}}'
    prompt = "A shared preamble about rivers and mountains and the sea. " * 6
    usages = [post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 3}).json()["usage"] for _ in range(2)]
    refusals = [post(base, "/v1/completions", {"prompt": "hi", "model": "nope"}),      # unknown model
                post(base, "/v1/completions", {"prompt": "hi", "max_tokens": -1}),     # validation
                post(base, "/v1/completions", {"prompt": "word " * 9000}),             # too long
                post(base, "/v1/completions", {"prompt": "hi", "suffix": "x"})]       # unsupported
    assert [r.status_code for r in refusals] == [404, 400, 400, 400]
    after = scrape(base)
    assert after[rejected] - before.get(rejected, 0) == len(refusals)
    for family in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_prompt_tokens", "request_generation_tokens"):
        key = f"kvstrata_{family}_count{{{label}}}"
        assert after[key] - before.get(key, 0) == 2, key
    queries, hits = (f"kvstrata_prefix_cache_{kind}_total{{{label}}}" for kind in ("queries", "hits"))
    assert after[queries] - before[queries] == sum(u["prompt_tokens"] for u in usages)
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert after[hits] - before[hits] == cached >= 64
    assert 0.0 <= after[f"kvstrata_kv_cache_usage_perc{{{label}}}"] <= 1.0
    step = {part: after[f'kvstrata_engine_step_seconds_total{{part="{part}"}}'] - before.get(
        f'kvstrata_engine_step_seconds_total{{part="{part}"}}', 0) for part in ("schedule", "model", "rest")}
    assert step["model"] > 0 and step["schedule"] > 0 and step["rest"] >= 0, step
    assert "process_cpu_seconds_total" in httpx.get(f"{base}/metrics").text


def test_one_log_line_per_request(server, caplog):
    base, _ = server
    with caplog.at_level(logging.INFO, logger="kvstrata.entrypoints.openai.requests"):
        response = post(base, "/v1/completions", {"prompt": "Say hi", "max_tokens": 3, "ignore_eos": True})
        post(base, "/v1/completions", {"prompt": "hi", "suffix": "x"})
    request_id = response.json()["id"]
    lines = [r.getMessage() for r in caplog.records if r.name == "kvstrata.entrypoints.openai.requests"]
    mine = [line for line in lines if request_id in line]
    assert len(mine) == 1 and "3 output tokens" in mine[0] and "(0 cached)" in mine[0] and "ttft" in mine[0]
    assert "finish length" in mine[0]
    assert any("rejected (400, param suffix)" in line for line in lines)
