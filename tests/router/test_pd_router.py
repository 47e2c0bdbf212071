"""`kvstrata router --pd-disaggregation` over real engines and a real Redis: greedy outputs equal
colocated serving, the handoff is counted, and every fault (a client leaving at each of four points,
a decode engine dying mid-stream, a prefill engine down, Redis killed) ends every request and leaves
both engines' books clean, with nothing held at rest."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from kvstrata.router.forwarding import ENGINE_HEADER
from kvstrata.router.policies import cached_tokens
from tests.entrypoints.server_helpers import blocks_at_rest, free_port, running_server, scrape, serving, wait_idle
from tests.kvcache.stores.store_helpers import redis_server  # noqa: F401  (fixture)
from tests.router.router_helpers import fake_engine, running_router

PROMPT = "Shared context: " + "the quick brown fox jumps over the lazy dog. " * 8 + "Now answer in a sentence:"
LONG_PROMPT = "Long document: " + "a tale of two cities, it was the best of times. " * 90 + "Summary:"


def prefill_engine(stack: ExitStack, smollm2, store: str, **options):
    return stack.enter_context(running_server(smollm2, store=store, disaggregation_mode="prefill",
                                              write_policy="write_through", persist=False, **options))


def decode_engine(stack: ExitStack, smollm2, store: str, **options):
    return stack.enter_context(running_server(smollm2, store=store, disaggregation_mode="decode", persist=False,
                                              **options))


def pd_router(stack: ExitStack, smollm2, prefill: list[str], decode: list[str], **options):
    return stack.enter_context(running_router([], smollm2.tokenizer, prefill=tuple(prefill), decode=tuple(decode),
                                              **options))


def at_rest(*servers) -> None:
    """Nothing left in the engine, its audit passes, and no device block is used or in flight."""
    for base, engine in servers:
        wait_idle(engine)
        deadline = time.monotonic() + 10
        while engine.tiers.has_transfers and time.monotonic() < deadline:   # orphaned loads settle
            time.sleep(0.05)
        engine.scheduler.audit()
        blocks = blocks_at_rest(base)
        assert blocks["used"] == 0 and blocks["in_flight"] == 0, (base, blocks)


def complete(base: str, prompt: str = PROMPT, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **body})


def streamed_chat(base: str, messages: list[dict], max_tokens: int = 12) -> tuple[str, str, list[str]]:
    """(the reply's text, the engine that served it, the events) of a streamed chat request."""
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                      json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        engine = r.headers.get(ENGINE_HEADER, base)
    chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return text, engine, lines


def router_metric(metrics: dict[str, float], name: str, label: str = "") -> float:
    return metrics.get(f"kvstrata_router_{name}{{{label}}}" if label else f"kvstrata_router_{name}", 0.0)


def colocated_answers(stack: ExitStack, smollm2, turn1: list[dict]) -> tuple[str, str, list[dict], str]:
    """What a colocated engine answers, greedily: PROMPT's completion, a conversation's first turn, its
    second turn's messages and the reply to them (what the disaggregated fleet must equal)."""
    colocated, _ = stack.enter_context(running_server(smollm2))
    text = complete(colocated).json()["choices"][0]["text"]
    first, _, _ = streamed_chat(colocated, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": first}, {"role": "user", "content": "And why?"}]
    second, _, _ = streamed_chat(colocated, turn2)
    return text, first, turn2, second


def test_disaggregated_fleet_equals_colocated_serving(smollm2, redis_server):  # noqa: F811
    turn1 = [{"role": "user", "content": "Please list three colours of the rainbow and explain briefly. " * 3}]
    with ExitStack() as stack:
        expected_text, expected_reply, turn2, expected_second = colocated_answers(stack, smollm2, turn1)
        prefill = prefill_engine(stack, smollm2, redis_server.url)
        decodes = [decode_engine(stack, smollm2, redis_server.url) for _ in range(2)]
        base, _ = pd_router(stack, smollm2, [prefill[0]], [d[0] for d in decodes])

        reply = complete(base)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected_text
        usage = reply.json()["usage"]
        handed = (usage["prompt_tokens"] - 1) // 16 * 16
        assert (usage["kv_transfer"]["handed_over_tokens"], usage["kv_transfer"]["recomputed_tokens"]) == (handed, 0)
        first, engine1, _ = streamed_chat(base, turn1)
        second, engine2, _ = streamed_chat(base, turn2)
        assert (first, second) == (expected_reply, expected_second)
        assert engine1 == engine2                      # the conversation's decode engine holds its earlier turn
        samples = complete(base, n=2, temperature=1.0, seed=3)      # not handed over: served colocated
        assert samples.status_code == 200 and len(samples.json()["choices"]) == 2
        metrics = scrape(base)
        decode_metrics = scrape(engine1)
        at_rest(prefill, *decodes)
    assert router_metric(metrics, "handoffs_total", 'outcome="handed_over"') == 3
    assert router_metric(metrics, "handoff_fallbacks_total", 'reason="samples"') == 1
    assert router_metric(metrics, "handed_over_tokens_total") >= handed + 2 * 32
    assert router_metric(metrics, "prefill_seconds_count") == 3
    assert router_metric(metrics, "transfer_seconds_count", 'part="decode_first_bytes"') == 2
    assert decode_metrics['kvstrata_prompt_tokens_total{source="store"}'] >= 32


def test_prompts_a_decode_engine_nearly_holds_are_prefilled_there(smollm2, redis_server):  # noqa: F811
    """--local-prefill-tokens: a short prompt, and a long conversation's next turn (whose earlier turn its
    decode engine holds), are prefilled by the decode engine; the long first turn is handed over. Greedy
    outputs equal colocated serving's either way."""
    turn1 = [{"role": "user", "content": LONG_PROMPT}]
    with ExitStack() as stack:
        expected_short, expected_first, turn2, expected_second = colocated_answers(stack, smollm2, turn1)
        prefill = prefill_engine(stack, smollm2, redis_server.url)
        decode = decode_engine(stack, smollm2, redis_server.url)
        base, fleet = pd_router(stack, smollm2, [prefill[0]], [decode[0]], local_prefill_tokens=200)

        short = complete(base)
        assert short.json()["choices"][0]["text"] == expected_short and "kv_transfer" not in short.json()["usage"]
        first, _, _ = streamed_chat(base, turn1)
        assert first == expected_first
        second_prompt = asyncio.run(fleet.routed_prompt("/v1/chat/completions", {"messages": turn2}))
        deadline = time.monotonic() + 10         # the router learns of the first turn's blocks from KV events
        while cached_tokens(fleet.decode.views[0], second_prompt) < 1000:
            assert time.monotonic() < deadline, "the decode engine's KV events never showed the first turn"
            time.sleep(0.05)
        second, _, _ = streamed_chat(base, turn2)
        assert second == expected_second
        metrics = scrape(base)
        at_rest(prefill, decode)
    assert router_metric(metrics, "handoffs_total", 'outcome="prefilled_locally"') == 2
    assert router_metric(metrics, "handoffs_total", 'outcome="handed_over"') == 1


class Blackhole:
    """A TCP server that accepts connections and never answers: an engine that takes a request and hangs."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@contextmanager
def blackhole():
    hole = Blackhole()
    try:
        yield hole
    finally:
        hole.close()


def leave_after(base: str, seconds: float, body: dict, chunks: int = 0) -> None:
    """Send a streamed completion and go away after `seconds` without an answer, or after `chunks` events."""
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                          timeout=httpx.Timeout(seconds)) as reply:
            for index, _ in enumerate(reply.iter_lines()):
                if index >= chunks:
                    return
    except httpx.ReadTimeout:
        return


def test_a_client_leaving_at_each_point_frees_everything_on_both_engines(smollm2, redis_server):  # noqa: F811
    """During the prefill, between the two legs (the decode engine has not taken it), during the decode
    engine's load, during the decode: each leaves both engines with nothing held."""
    with ExitStack() as stack:
        prefill = prefill_engine(stack, smollm2, redis_server.url, max_num_batched_tokens=8)
        decode_base, decode = decode_engine(stack, smollm2, redis_server.url, store_timeout=8.0)
        hole = stack.enter_context(blackhole())
        base, fleet = pd_router(stack, smollm2, [prefill[0]], [hole.url, decode_base], wait_for=2,
                                health_interval=30)

        # 1. During the prefill: a long prompt, 8 tokens a step, and a client that leaves after 0.5 s.
        leave_after(base, 0.5, {"prompt": LONG_PROMPT, "max_tokens": 4})
        at_rest(prefill)
        assert prefill[1].stats.prompt_tokens_computed < len(smollm2.tokenizer.encode(LONG_PROMPT))
        aborted = 'kvstrata_requests_finished_total{model_name="SmolLM2-135M-Instruct",outcome="abort"}'
        assert scrape(prefill[0])[aborted] == 1

        # 2. Between the legs: the decode engine chosen (a hung one) never takes the request.
        hole_view = next(view for view in fleet.views if view.url == hole.url)
        hole_view.available = True
        leave_after(base, 2.0, {"prompt": PROMPT + " one", "max_tokens": 4})
        hole_view.available = False
        at_rest(prefill, (decode_base, decode))
        assert decode.stats.generated_tokens == 0

        # 3. During the decode engine's load: its store answers after 3 s; the client leaves before.
        real_get = decode.store.get

        def slow_get(keys):
            time.sleep(3.0)
            return real_get(keys)
        decode.store.get = slow_get
        leave_after(base, 1.5, {"prompt": PROMPT + " two", "max_tokens": 4})
        at_rest(prefill, (decode_base, decode))
        decode.store.get = real_get
        assert decode.tiers.stats.orphaned_loads == 1          # the load outlived its request, then settled

        # 4. During the decode: three events of a long reply, then gone.
        leave_after(base, 30, {"prompt": PROMPT + " three", "max_tokens": 200, "ignore_eos": True}, chunks=3)
        at_rest(prefill, (decode_base, decode))
        assert decode.stats.generated_tokens < 100
        metrics = scrape(base)
        assert complete(base).status_code == 200            # the fleet serves on
        at_rest(prefill, (decode_base, decode))
    assert router_metric(metrics, "handoff_aborts_total", 'phase="prefill"') == 1
    assert router_metric(metrics, "handoff_aborts_total", 'phase="decode"') == 2      # 2 and 3
    assert router_metric(metrics, "handoffs_total", 'outcome="client_gone"') == 3


def test_a_decode_engine_dying_mid_stream_ends_that_stream_and_the_next_go_elsewhere(smollm2, redis_server):  # noqa: F811
    with ExitStack() as stack:
        colocated, _ = stack.enter_context(running_server(smollm2))
        expected = complete(colocated).json()["choices"][0]["text"]
        prefill = prefill_engine(stack, smollm2, redis_server.url)
        dying = stack.enter_context(serving(fake_engine("break")))
        decode = decode_engine(stack, smollm2, redis_server.url)
        base, fleet = pd_router(stack, smollm2, [prefill[0]], [dying, decode[0]])
        _, engine, lines = streamed_chat(base, [{"role": "user", "content": "Hi"}])
        assert engine == dying
        assert '"engine_failed"' in lines[-2] and lines[-1] == "data: [DONE]"     # ended, never hung
        assert not next(view for view in fleet.views if view.url == dying).available
        replies = [complete(base) for _ in range(3)]
        assert all(r.status_code == 200 and r.headers[ENGINE_HEADER] == decode[0] for r in replies)
        assert all(r.json()["choices"][0]["text"] == expected for r in replies)
        at_rest(prefill, decode)


def test_a_prefill_engine_down_costs_a_retry_or_colocated_serving(smollm2, redis_server):  # noqa: F811
    dead = f"http://127.0.0.1:{free_port()}"                 # nothing listens there
    with ExitStack() as stack:
        colocated, _ = stack.enter_context(running_server(smollm2))
        expected = complete(colocated).json()["choices"][0]["text"]
        prefill = prefill_engine(stack, smollm2, redis_server.url)
        decode = decode_engine(stack, smollm2, redis_server.url)
        base, fleet = pd_router(stack, smollm2, [dead, prefill[0]], [decode[0]], wait_for=2, health_interval=30)
        fleet.views[0].available = True        # as if it died after its last health check
        retried = complete(base)               # kv_aware's tie goes to the first: dead, then the live one
        assert retried.status_code == 200 and retried.json()["choices"][0]["text"] == expected
        assert retried.json()["usage"]["kv_transfer"]["handed_over_tokens"] > 0
        fleet.take_out(fleet.views[1], "the test")     # now no prefill engine at all: colocated on the decode engine
        fallen = complete(base, prompt=PROMPT + " again")
        assert fallen.status_code == 200 and "kv_transfer" not in fallen.json()["usage"]
        metrics = scrape(base)
        at_rest(prefill, decode)
    assert router_metric(metrics, "requests_total", f'engine="{dead}",outcome="retried"') == 1
    assert router_metric(metrics, "handoffs_total", 'outcome="handed_over"') == 1
    assert router_metric(metrics, "handoff_fallbacks_total", 'reason="prefill_down"') == 1


@pytest.mark.parametrize("when", ["before", "between"])
def test_redis_killed_costs_recomputation_only(smollm2, redis_server, when):  # noqa: F811
    """Redis dies before the prefill (nothing is stored) or between the legs (stored, then gone): the
    decode engine computes what it cannot load, and answers exactly as colocated serving does."""
    with ExitStack() as stack:
        colocated, _ = stack.enter_context(running_server(smollm2))
        expected = complete(colocated).json()["choices"][0]["text"]
        prefill = prefill_engine(stack, smollm2, redis_server.url, store_timeout=1.0)
        decode = decode_engine(stack, smollm2, redis_server.url, store_timeout=1.0)
        if when == "before":
            base, _ = pd_router(stack, smollm2, [prefill[0]], [decode[0]])
            redis_server.kill()
            reply = complete(base)
            assert reply.json()["usage"]["kv_transfer"]["handed_over_tokens"] == 0
        else:                                  # the legs by hand, so Redis dies exactly between them
            first = httpx.post(f"{prefill[0]}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}})
            params = first.json()["kv_transfer_params"]
            assert params["num_stored_blocks"] > 0
            redis_server.kill()
            reply = complete(decode[0], kv_transfer_params=params)
            handed = reply.json()["usage"]["kv_transfer"]["handed_over_tokens"]
            assert handed > 0 and reply.json()["usage"]["kv_transfer"]["recomputed_tokens"] == handed
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
        at_rest(prefill, decode)
        redis_server.start()                   # the fixture's teardown kills it again


def test_a_handoff_under_a_lora_adapter_reaches_the_decode_engine_by_the_adapters_keys(smollm2, redis_server,  # noqa: F811
                                                                                   lora_adapters):
    """Prefill and decode engines that loaded the same adapter files compute the same block keys: the
    decode engine loads every full block the prefill computed under the adapter, recomputes none, and
    answers as a colocated engine under the adapter does; the base model's blocks are not the adapter's."""
    adapter = (f"alpha={lora_adapters['alpha']}",)
    with ExitStack() as stack:
        colocated, _ = stack.enter_context(running_server(smollm2, lora_modules=adapter))
        expected = complete(colocated, model="alpha").json()["choices"][0]["text"]
        expected_base = complete(colocated).json()["choices"][0]["text"]
        assert expected != expected_base
        prefill = prefill_engine(stack, smollm2, redis_server.url, lora_modules=adapter)
        decode = decode_engine(stack, smollm2, redis_server.url, lora_modules=adapter)
        base, _ = pd_router(stack, smollm2, [prefill[0]], [decode[0]])
        reply = complete(base, model="alpha")
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == expected
        usage = reply.json()["usage"]
        handed = (usage["prompt_tokens"] - 1) // 16 * 16
        assert (usage["kv_transfer"]["handed_over_tokens"], usage["kv_transfer"]["recomputed_tokens"]) == (handed, 0)
        plain = complete(base).json()                     # the same prompt for the base: its own blocks, its answer
        assert plain["choices"][0]["text"] == expected_base and plain["model"] != "alpha"
        at_rest(prefill, decode)
