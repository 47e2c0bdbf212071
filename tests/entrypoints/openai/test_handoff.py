"""A prefill engine and a decode engine over one real Redis, spoken to directly (the router's part is
tests/router/test_pd_router.py): greedy outputs equal colocated serving, the handoff is counted, a
record corrupted or missing in the store is recomputed, and each role refuses the other's handoff."""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from tests.entrypoints.server_helpers import blocks_at_rest, running_server, scrape, wait_idle
from tests.kvcache.stores.store_helpers import redis_server  # noqa: F401  (fixture)

PROMPT = "Shared context: " + "the quick brown fox jumps over the lazy dog. " * 8 + "Now answer in a sentence:"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow, and say why the sky is blue. " * 3}]


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=120)


def handed_off(prefill: str, decode: str, path: str, body: dict) -> tuple[dict, dict]:
    """(prefill answer, decode answer) of one request handed from one engine to the other."""
    first = post(prefill, path, {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    second = post(decode, path, {**body, "kv_transfer_params": params})
    assert second.status_code == 200, second.text
    return first.json(), second.json()


def pair(stack: ExitStack, smollm2, store: str, **options):
    prefill = stack.enter_context(running_server(smollm2, store=store, disaggregation_mode="prefill",
                                                 write_policy="write_through", persist=False, **options))
    decode = stack.enter_context(running_server(smollm2, store=store, disaggregation_mode="decode", persist=False,
                                                **options))
    return prefill, decode


def assert_at_rest(*servers) -> None:
    for base, engine in servers:
        wait_idle(engine)
        engine.scheduler.audit()
        blocks = blocks_at_rest(base)
        assert blocks["used"] == 0 and blocks["in_flight"] == 0, (base, blocks)


def test_handoff_equals_colocated_and_is_counted(smollm2, redis_server):  # noqa: F811
    completion = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    chat = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    with ExitStack() as stack:
        colocated, _ = stack.enter_context(running_server(smollm2))
        expected_text = post(colocated, "/v1/completions", completion).json()["choices"][0]["text"]
        expected_chat = post(colocated, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        (prefill, p_engine), (decode, d_engine) = pair(stack, smollm2, redis_server.url)
        first, second = handed_off(prefill, decode, "/v1/completions", completion)
        params = first["kv_transfer_params"]
        assert first["usage"]["completion_tokens"] == 1
        assert params["num_stored_blocks"] == len(params["block_hashes"]) == (len(params["prompt_token_ids"]) - 1) // 16
        assert second["choices"][0]["text"] == expected_text
        handed = params["num_stored_blocks"] * 16
        transfer = second["usage"]["kv_transfer"]
        assert (transfer["handed_over_tokens"], transfer["recomputed_tokens"]) == (handed, 0)
        assert transfer["load_seconds"] > 0 and transfer["store_wait_seconds"] == round(params["store_wait_seconds"], 6)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == handed
        _, chat_reply = handed_off(prefill, decode, "/v1/chat/completions", chat)
        assert chat_reply["choices"][0]["message"]["content"] == expected_chat
        p_metrics, d_metrics = scrape(prefill), scrape(decode)
        assert_at_rest((prefill, p_engine), (decode, d_engine))
    assert p_metrics['kvstrata_kv_transfer_requests_total{model_name="SmolLM2-135M-Instruct",outcome="stored_all",'
                     'role="prefill"}'] == 2
    assert d_metrics['kvstrata_kv_transfer_requests_total{model_name="SmolLM2-135M-Instruct",outcome="loaded",'
                     'role="decode"}'] == 2
    assert d_metrics['kvstrata_prompt_tokens_total{source="store"}'] >= handed


def test_a_corrupt_or_missing_record_is_recomputed(smollm2, redis_server):  # noqa: F811
    """One record flipped, another deleted: the decode engine recomputes from there, counts it, and
    answers exactly what colocated serving answers."""
    completion = {"prompt": "Another context: " + "lorem ipsum dolor sit amet, " * 12, "max_tokens": 8,
                  "temperature": 0}
    client = redis_server.client()
    with ExitStack() as stack:
        colocated, _ = stack.enter_context(running_server(smollm2))
        expected = post(colocated, "/v1/completions", completion).json()["choices"][0]["text"]
        (prefill, p_engine), (decode, d_engine) = pair(stack, smollm2, redis_server.url)
        first = post(prefill, "/v1/completions", {**completion, "kv_transfer_params": {"do_remote_decode": True}})
        params = first.json()["kv_transfer_params"]
        assert params["num_stored_blocks"] >= 4
        key = f"kvstrata:{params['block_hashes'][2]}".encode()
        record = bytearray(client.get(key))
        record[len(record) // 2] ^= 0xFF
        client.set(key, bytes(record))
        client.delete(f"kvstrata:{params['block_hashes'][3]}")
        second = post(decode, "/v1/completions", {**completion, "kv_transfer_params": params}).json()
        assert second["choices"][0]["text"] == expected
        handed = params["num_stored_blocks"] * 16
        transfer = second["usage"]["kv_transfer"]
        assert (transfer["handed_over_tokens"], transfer["recomputed_tokens"]) == (handed, handed - 32)
        metrics = scrape(decode)
        assert_at_rest((prefill, p_engine), (decode, d_engine))
    assert metrics['kvstrata_load_failures_total{reason="checksum"}'] == 1
    assert metrics['kvstrata_kv_transfer_requests_total{model_name="SmolLM2-135M-Instruct",outcome="recomputed",'
                   'role="decode"}'] == 1
    assert not client.exists(key)            # the bad record was deleted


def test_each_role_takes_only_its_own_handoff(smollm2, tmp_path):
    body = {"prompt": "Hello there", "max_tokens": 2}
    with ExitStack() as stack:
        plain, _ = stack.enter_context(running_server(smollm2))
        (prefill, _), (decode, _) = pair(stack, smollm2, "disk", store_path=str(tmp_path))
        refusals = [
            post(plain, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}}),
            post(decode, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}}),
            post(prefill, "/v1/completions", {**body, "kv_transfer_params": {"do_remote_prefill": True,
                                                                              "prompt_token_ids": [1, 2]}}),
            post(prefill, "/v1/completions", {**body, "stream": True, "kv_transfer_params": {"do_remote_decode": True}}),
            post(prefill, "/v1/completions", {**body, "kv_transfer_params": {}}),
        ]
        assert [r.status_code for r in refusals] == [400] * 5, [r.text for r in refusals]
        assert all(r.json()["error"]["param"] in ("kv_transfer_params", "stream") for r in refusals[:4])
        assert post(prefill, "/v1/completions", body).status_code == 200      # ordinary requests: served
        assert post(decode, "/v1/completions", body).status_code == 200
