"""`kvstrata router` over real engines: cache-aware routing, engines dying and coming back."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from kvstrata.core.front_door import DoorRules
from kvstrata.router.forwarding import ENGINE_HEADER
from tests.entrypoints.server_helpers import running_server, scrape, serving
from tests.router.router_helpers import chat, fake_engine, running_router

CONVERSATIONS = 8
TURNS = 3


def _conversation_opening(index: int) -> str:
    # Long enough to fill blocks of their own past the chat template's shared system prompt.
    return (f"Conversation number {index}: please remember the words {' '.join(f'w{index}x{k}' for k in range(12))}"
            " and answer briefly.")


def _run_conversations(base: str, served: dict[str, str] | None = None) -> tuple[dict[int, list[str]], int, int]:
    """Every conversation resent with its growing history, turn by turn; (engines per turn, cached, prompt).
    `served` collects each response's id and the engine that served it."""
    histories = {c: [{"role": "user", "content": _conversation_opening(c)}] for c in range(CONVERSATIONS)}
    engines: dict[int, list[str]] = {c: [] for c in range(CONVERSATIONS)}
    cached = prompt = 0
    for turn in range(TURNS):
        for c in [(turn + k) % CONVERSATIONS for k in range(CONVERSATIONS)]:   # rotated: no fixed parity
            reply = chat(base, histories[c])
            assert reply.status_code == 200, reply.text
            engines[c].append(reply.headers[ENGINE_HEADER])
            if served is not None:
                served[reply.json()["id"]] = reply.headers[ENGINE_HEADER]
            usage = reply.json()["usage"]
            if turn > 0:
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
            histories[c] += [{"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": f"And turn {turn + 1}?"}]
    return engines, cached, prompt


def _two_engines(stack: ExitStack, smollm2, store_path) -> list[str]:
    # One disk store under both; persist off, so only what an engine holds can hit there.
    return [stack.enter_context(running_server(smollm2, store="disk", store_path=str(store_path), persist=False,
                                               threads=1))[0] for _ in range(2)]


@pytest.mark.parametrize("policy", ["kv_aware", pytest.param("round_robin", marks=pytest.mark.slow)])   # the contrast: 8-16 s
def test_kv_aware_keeps_conversations_on_their_engine(smollm2, tmp_path, policy):
    with ExitStack() as stack:
        engines = _two_engines(stack, smollm2, tmp_path / "store")
        base, fleet = stack.enter_context(running_router(engines, smollm2.tokenizer, policy))
        ids: dict[str, str] = {}
        served, cached, prompt = _run_conversations(base, ids)
        metrics = scrape(base)
        # where each request's time went, gathered from both engines and marked with the one that served it
        timelines = httpx.get(f"{base}/v1/timelines", params=[("id", i) for i in [*ids, "cmpl-unknown"]]).json()
    assert {rid: t["engine"] for rid, t in timelines["timelines"].items()} == ids
    assert all(t["spans"] for t in timelines["timelines"].values())
    spans = [len(set(turns)) for turns in served.values()]
    routed = sum(v for k, v in metrics.items() if k.startswith("kvstrata_router_requests_total"))
    assert routed == CONVERSATIONS * TURNS
    predicted = sum(v for k, v in metrics.items() if k.startswith("kvstrata_router_predicted_hit_tokens_total"))
    if policy == "kv_aware":
        assert spans == [1] * CONVERSATIONS, served
        assert cached > 0.5 * prompt, (cached, prompt)
        assert predicted > 0
    else:
        assert max(spans) == 2, served
        assert cached < 0.5 * prompt, (cached, prompt)


def _stream(base: str, text: str) -> tuple[int, str]:
    """(status, body) of a streamed chat request, read to its end."""
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": 24, "temperature": 0,
                            "stream": True}) as reply:
        return reply.status_code, "".join(reply.iter_text())


@pytest.mark.slow     # 35 s: an engine restarted; a dying decode engine (test_pd_router) and a dead one (below) stay fast
def test_engine_killed_mid_run_then_back(smollm2, tmp_path):
    """A killed engine is taken out; its requests go to the other one; every request ends; it comes back."""
    from tests.entrypoints.server_helpers import free_port, start_server_process

    flags = ("--kv-cache-memory", "64MiB", "--dtype", "float32", "--threads", "1", "--log-level", "WARNING")
    port = free_port()
    logs = [open(tmp_path / f"engine{i}.log", "w") for i in range(3)]
    survivor, url_a = start_server_process(*flags, log=logs[0])
    victim, url_b = start_server_process(*flags, log=logs[1], port=port)
    try:
        with running_router([url_a, url_b], smollm2.tokenizer, "round_robin") as (base, fleet):
            assert chat(base, [{"role": "user", "content": "Hi"}]).headers[ENGINE_HEADER] == url_a
            request = {"messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 64,
                       "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=request, timeout=60) as stream:
                assert stream.headers[ENGINE_HEADER] == url_b       # round robin: the second goes to B
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                victim.kill()                                       # mid-stream
                rest = list(lines)
            assert any('"engine_failed"' in line for line in rest) and "data: [DONE]" in rest, rest[-3:]

            prompts = [f"Count from {i} to {i + 30}, one number per line." for i in range(8)]

            def one(i: int) -> tuple[int, str]:
                return _stream(base, prompts[i]) if i % 2 else (chat(base, [{"role": "user", "content": prompts[i]}],
                                                                      max_tokens=24).status_code, "")

            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(one, range(len(prompts))))   # each ends: none hangs (60 s timeouts)
            for status, body in results:
                assert status == 200
                assert body == "" or (body.rstrip().endswith("data: [DONE]") and "engine_failed" not in body)
            view_b = next(v for v in fleet.views if v.url == url_b)
            assert not view_b.available
            after = [chat(base, [{"role": "user", "content": "Hi"}]) for _ in range(4)]
            assert all(r.status_code == 200 and r.headers[ENGINE_HEADER] == url_a for r in after)
            metrics = scrape(base)
            assert metrics[f'kvstrata_router_engine_up{{engine="{url_b}"}}'] == 0
            assert metrics[f'kvstrata_router_engine_failures_total{{engine="{url_b}"}}'] >= 1

            revived, _ = start_server_process(*flags, log=logs[2], port=port)
            try:
                for _ in range(200):
                    if view_b.available:
                        break
                    time.sleep(0.05)
                assert view_b.available
                served = {chat(base, [{"role": "user", "content": "Hi"}]).headers[ENGINE_HEADER] for _ in range(4)}
                assert served == {url_a, url_b}
            finally:
                revived.kill()
                revived.wait()
    finally:
        for proc in (survivor, victim):
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()


def test_request_to_an_engine_not_yet_found_dead_is_sent_to_another(smollm2):
    """The router has not noticed yet (the engine looks in): the request that finds out goes elsewhere."""
    from tests.entrypoints.server_helpers import free_port

    dead = f"http://127.0.0.1:{free_port()}"                  # nothing listens there
    with running_server(smollm2) as (live, _), \
            running_router([dead, live], smollm2.tokenizer, "round_robin", wait_for=1,
                           health_interval=30) as (base, fleet):
        fleet.views[0].available = True     # as if it died after its last check (the next is 30 s away)
        replies = [chat(base, [{"role": "user", "content": "Hi"}]) for _ in range(2)]
        assert [r.status_code for r in replies] == [200, 200]
        assert {r.headers[ENGINE_HEADER] for r in replies} == {live}
        assert not fleet.views[0].available
        metrics = scrape(base)
    assert metrics[f'kvstrata_router_requests_total{{engine="{dead}",outcome="retried"}}'] == 1
    assert metrics[f'kvstrata_router_requests_total{{engine="{live}",outcome="ok"}}'] == 2


def test_timelines_come_from_the_engines_that_keep_them_and_not_from_those_down(smollm2):
    """One engine keeps a timeline, one answers 404 (it keeps none, as a peer), one is down: the router
    answers with the first's, marked with its URL, and without failing on the other two."""
    from tests.entrypoints.server_helpers import free_port

    keeping = fake_engine("ok")
    timeline = {"arrival": 1.0, "finished": 2.0, "received": 0.9, "first_sent": 1.5, "last_sent": 2.0, "spans": []}

    @keeping.get("/v1/timelines")
    async def timelines():
        return {"timelines": {"cmpl-a": timeline}}

    dead = f"http://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        kept, bare = (stack.enter_context(serving(app)) for app in (keeping, fake_engine("ok")))
        base, _ = stack.enter_context(running_router([kept, bare, dead], smollm2.tokenizer, wait_for=2))
        reply = httpx.get(f"{base}/v1/timelines", params=[("id", "cmpl-a"), ("id", "cmpl-b")])
    assert reply.status_code == 200
    assert reply.json() == {"timelines": {"cmpl-a": {**timeline, "engine": kept}}}


def test_router_health_models_keys_and_refusals(smollm2):
    """Engines with an API key: the router polls with --engine-api-key, passes clients' keys on, and
    relays the engines' answers (401, 400) as they are."""
    key = {"authorization": "Bearer k"}
    with running_server(smollm2, api_key="k") as (live, _), \
            running_router([live], smollm2.tokenizer, engine_api_key="k") as (base, _):
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "engines": {live: True}}
        models = httpx.get(f"{base}/v1/models", headers=key).json()
        assert models == httpx.get(f"{live}/v1/models", headers=key).json()
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 2}).status_code == 401
        bad = httpx.post(f"{base}/v1/chat/completions", json={"messages": [], "max_tokens": 2}, headers=key)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        good = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=key)
        assert good.status_code == 200 and good.headers[ENGINE_HEADER] == live


def test_a_router_with_its_own_key_keys_every_route_and_gives_the_engines_theirs(smollm2):
    """`kvstrata router --api-key`: every route but /health needs the router's key, checked before the
    body is read; the engines get --engine-api-key, never the client's; a body over the limit is 413."""
    mine, engines = {"authorization": "Bearer door"}, "Bearer k"
    with running_server(smollm2, api_key="k") as (live, _), \
            running_router([live], smollm2.tokenizer, engine_api_key="k", api_key="door",
                           door=DoorRules.of("door", False, 4096, 5.0)) as (base, _):
        assert httpx.get(f"{base}/health").status_code == 200
        for path in ("/metrics", "/v1/models", "/v1/timelines"):
            assert httpx.get(f"{base}{path}").status_code == 401, path
            assert httpx.get(f"{base}{path}", headers={"authorization": engines}).status_code == 401, path
        good = httpx.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, headers=mine)
        assert good.status_code == 200 and good.headers[ENGINE_HEADER] == live
        assert httpx.get(f"{base}/v1/models", headers=mine).status_code == 200
        big = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 2}, headers=mine)
        assert big.status_code == 413


def test_a_stream_that_breaks_ends_with_an_error_event_and_a_refusing_engine_is_skipped(smollm2):
    """Fake engines: one drops its stream after the first chunk, one answers 503, one works."""
    with ExitStack() as stack:
        broken, refusing, working = (stack.enter_context(serving(fake_engine(b)))
                                     for b in ("break", "refuse", "ok"))
        base, fleet = stack.enter_context(running_router([broken, refusing, working], smollm2.tokenizer,
                                                         "round_robin", health_interval=30))
        request = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=request, timeout=10) as stream:
            assert stream.headers[ENGINE_HEADER] == broken
            lines = [line for line in stream.iter_lines() if line]
        assert lines[0].startswith('data: {"choices"') and '"engine_failed"' in lines[1] and lines[2] == "data: [DONE]"
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=request, timeout=10) as stream:
            assert stream.headers[ENGINE_HEADER] == working     # the 503 took the refusing one out
            assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
        assert [view.available for view in fleet.views] == [False, False, True]
        metrics = scrape(base)
    assert metrics[f'kvstrata_router_requests_total{{engine="{broken}",outcome="error"}}'] == 1
    assert metrics[f'kvstrata_router_requests_total{{engine="{refusing}",outcome="retried"}}'] == 1


def test_the_router_sees_the_tokens_and_hashes_the_engine_caches(smollm2):
    """Same token ids as the engine's /tokenize (chat template, developer role, content parts, completions),
    and after a request, every full block the router hashes for it is in the engine's published device tier."""
    from kvstrata.router.fleet import PromptTokens

    tokens = PromptTokens(smollm2.tokenizer)
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a colour."}]}]
    with running_server(smollm2) as (live, _), running_router([live], smollm2.tokenizer) as (base, fleet):
        engine_ids = httpx.post(f"{live}/tokenize", json={"messages": messages}).json()["tokens"]
        assert tokens.ids("/v1/chat/completions", {"messages": messages}) == engine_ids
        assert tokens.ids("/v1/completions", {"prompt": "Once upon"}) == \
            httpx.post(f"{live}/tokenize", json={"prompt": "Once upon"}).json()["tokens"]
        assert tokens.ids("/v1/completions", {"prompt": [[5, 6, 7]]}) == [5, 6, 7]
        assert tokens.ids("/v1/chat/completions", {"messages": "not a list"}) is None
        long_chat = messages + [{"role": "user", "content": " ".join(f"word{k}" for k in range(40))}]
        assert chat(base, long_chat, max_tokens=2).status_code == 200
        prompt = asyncio.run(fleet.routed_prompt("/v1/chat/completions", {"messages": long_chat}))
        assert prompt.max_hit_blocks >= 3
        deadline = time.monotonic() + 5
        while not all(fleet.views[0].holds("device", h) for h in prompt.block_hashes):
            assert time.monotonic() < deadline, "the engine's events never named the prompt's blocks"
            time.sleep(0.05)


def test_the_router_hashes_an_adapters_prompt_with_its_root_as_the_engine_does(smollm2, lora_adapters):
    """A request naming a LoRA adapter: the router's hashes are the blocks the engine stored for it,
    none of them the base model's, so kv_aware never predicts a hit on another adapter's blocks."""
    prompt = " ".join(f"word{k}" for k in range(60))
    with running_server(smollm2, lora_modules=(f"alpha={lora_adapters['alpha']}",)) as (live, _), \
            running_router([live], smollm2.tokenizer) as (base, fleet):
        reply = httpx.post(f"{base}/v1/completions", json={"model": "alpha", "prompt": prompt, "max_tokens": 2})
        assert reply.status_code == 200 and reply.json()["model"] == "alpha"
        routed = asyncio.run(fleet.routed_prompt("/v1/completions", {"model": "alpha", "prompt": prompt}))
        as_base = asyncio.run(fleet.routed_prompt("/v1/completions", {"prompt": prompt}))
        assert routed.max_hit_blocks >= 3 and not set(routed.block_hashes) & set(as_base.block_hashes)
        deadline = time.monotonic() + 5
        while not all(fleet.views[0].holds("device", h) for h in routed.block_hashes):
            assert time.monotonic() < deadline, "the engine's events never named the adapter's blocks"
            time.sleep(0.05)
        assert not any(fleet.views[0].holds("device", h) for h in as_base.block_hashes)


@pytest.mark.parametrize("argv, message", [
    (["--engine", "ftp://x"], "must be an http"),
    (["--engine", "http://a", "--engine", "http://a"], "given twice"),
])
def test_router_command_refuses_bad_engines(capsys, argv, message):
    from kvstrata.entrypoints.cli.main import main

    assert main(["router", *argv]) == 2
    assert message in capsys.readouterr().err

