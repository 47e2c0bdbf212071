"""LoRA adapters over HTTP, as vLLM serves them: `model` picks an adapter, /v1/models lists them with
their base as parent, /v1/load_lora_adapter and /v1/unload_lora_adapter at run time (with
--allow-runtime-lora-updating); a bad name is a 4xx naming the problem, a bad path one fixed 400
(test_lora_hostile.py), and nothing is held after."""

import httpx
import openai
import pytest

from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, wait_idle

PROMPT = "Rivers, castles and vineyards shaped the Loire valley over many centuries of history. " * 3 + "In short:"


@pytest.fixture(scope="module")
def server(smollm2, lora_adapters):
    with running_server(smollm2, num_device_blocks=128, block_size=16, lora_modules=(f"alpha={lora_adapters['alpha']}",),
                        max_loras=2, allow_runtime_lora_updating=True) as (base, engine):
        yield base, engine


def _complete(base, model, **extra):
    return httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                       "temperature": 0, "ignore_eos": True, **extra}, timeout=60)


def test_models_lists_adapters_with_their_base_as_parent(server, lora_adapters):
    base, _ = server
    cards = {card["id"]: card for card in httpx.get(f"{base}/v1/models").json()["data"]}
    assert cards[MODEL]["parent"] is None
    assert cards["alpha"]["parent"] == MODEL and cards["alpha"]["root"] == str(lora_adapters["alpha"])
    assert "runs" in cards[MODEL] and "runs" not in cards["alpha"]        # an adapter runs on the base's path
    assert httpx.get(f"{base}/v1/models/alpha").json()["id"] == "alpha"


def test_model_picks_the_adapter_and_its_blocks_are_its_own(server):
    base, engine = server
    plain = _complete(base, MODEL).json()
    first = _complete(base, "alpha").json()
    again = _complete(base, "alpha").json()
    assert first["model"] == "alpha" and plain["model"] == MODEL
    assert first["choices"][0]["text"] != plain["choices"][0]["text"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0          # the base's blocks were there
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "alpha"
    wait_idle(engine)
    rest = blocks_at_rest(base)
    assert rest["used"] == 0 and rest["in_flight"] == 0


def test_load_and_unload_at_run_time(server, lora_adapters, tmp_path):
    base, engine = server
    load = lambda **body: httpx.post(f"{base}/v1/load_lora_adapter", json=body, timeout=60)   # noqa: E731
    unload = lambda name: httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name})  # noqa: E731
    assert load(lora_name="beta", lora_path=str(lora_adapters["beta"])).status_code == 200
    assert _complete(base, "beta").json()["model"] == "beta"
    again = load(lora_name="beta", lora_path=str(lora_adapters["gamma"]))
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    first = _complete(base, "beta").json()
    assert load(lora_name="beta", lora_path=str(lora_adapters["gamma"]), load_inplace=True).status_code == 200
    replaced = _complete(base, "beta").json()
    assert replaced["usage"]["prompt_tokens_details"]["cached_tokens"] == 0       # new weights, none of the old KV
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert unload("beta").status_code == 200
    assert _complete(base, "beta").status_code == 404
    assert unload("beta").status_code == 404
    wait_idle(engine)
    rest = blocks_at_rest(base)
    assert rest["used"] == 0 and rest["in_flight"] == 0


@pytest.mark.parametrize("body, status, words", [
    ({"lora_name": "x", "lora_path": "/nowhere"}, 400, "cannot load a LoRA adapter from this path"),
    ({"lora_name": MODEL, "lora_path": "/nowhere"}, 400, "base model"),
    ({"lora_name": "x"}, 400, "lora_path"),
])
def test_bad_loads_are_4xx_naming_the_problem(server, body, status, words):
    base, engine = server
    reply = httpx.post(f"{base}/v1/load_lora_adapter", json=body)
    assert reply.status_code == status and words in str(reply.json()), reply.text
    assert "x" not in engine.adapters.registered


def test_an_unknown_model_is_404_listing_what_is_served(server):
    reply = _complete(server[0], "nope")
    assert reply.status_code == 404 and "'alpha'" in reply.json()["error"]["message"]
