"""`kvstrata router` over real engines: cache-aware routing, engines dying and coming back."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest
from router_helpers import chat, running_router
from server_helpers import running_server, scrape

from kvstrata.router import ENGINE_HEADER

CONVERSATIONS = 8
TURNS = 3


def _conversation_opening(index: int) -> str:
    # Long enough to fill blocks of their own past the chat template's shared system prompt.
    return (f"Conversation number {index}: please remember the words {' '.join(f'w{index}x{k}' for k in range(12))}"
            " and answer briefly.")


def _run_conversations(base: str) -> tuple[dict[int, list[str]], int, int]:
    """Every conversation resent with its growing history, turn by turn; (engines per turn, cached, prompt)."""
    histories = {c: [{"role": "user", "content": _conversation_opening(c)}] for c in range(CONVERSATIONS)}
    engines: dict[int, list[str]] = {c: [] for c in range(CONVERSATIONS)}
    cached = prompt = 0
    for turn in range(TURNS):
        for c in [(turn + k) % CONVERSATIONS for k in range(CONVERSATIONS)]:   # rotated: no fixed parity
            reply = chat(base, histories[c])
            assert reply.status_code == 200, reply.text
            engines[c].append(reply.headers[ENGINE_HEADER])
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


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_kv_aware_keeps_conversations_on_their_engine(smollm2, tmp_path, policy):
    with ExitStack() as stack:
        engines = _two_engines(stack, smollm2, tmp_path / "store")
        base, fleet = stack.enter_context(running_router(engines, smollm2.tokenizer, policy))
        served, cached, prompt = _run_conversations(base)
        metrics = scrape(base)
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
