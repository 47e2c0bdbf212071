"""Prefill/decode disaggregation on an engine's side (docs/design/disaggregation.md): the handoff a
request asks for (`kv_transfer_params`), whether this engine's `--disaggregation-mode` takes it, and
the handoff's parts of the response.

    prefill  `{"do_remote_decode": true}`: one token, not streamed; the prompt's full blocks are in the
             store before the answer goes out, and the answer's `kv_transfer_params` say which
    decode   that `kv_transfer_params`, as it came: the prompt is its token ids, and the blocks the
             prefill engine stored are store hits (the ordinary load path: a block missing or
             corrupt is recomputed); usage says how many tokens were handed over and recomputed
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.core.hashing import BlockHasher
from kvstrata.core.outputs import RequestOutput
from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.entrypoints.openai.protocol import KVTransferParams, SamplingBody
from kvstrata.entrypoints.openai.state import ServerState

PARAM = "kv_transfer_params"


@dataclass(frozen=True)
class Transfer:
    """One request's part in a handoff."""

    role: str                                  # "prefill" or "decode"
    prompt_token_ids: list[int] | None = None  # decode: the prompt
    handed_over_tokens: int = 0                # decode: prompt tokens whose KV the prefill engine stored
    store_wait_seconds: float = 0.0            # decode: how long the prefill engine waited for its writes


def transfer_of(state: ServerState, body: SamplingBody, num_prompts: int) -> Transfer | None:
    """The request's handoff, checked against this engine's role; None for an ordinary request."""
    params = body.kv_transfer_params
    if params is None:
        return None
    role = "prefill" if params.do_remote_decode else "decode"
    if state.disaggregation_mode != role:
        raise ApiError(400, f"this engine does not take {role} handoffs (it runs --disaggregation-mode "
                            f"{state.disaggregation_mode})", param=PARAM)
    if num_prompts != 1 or (body.n or 1) > 1 or (body.best_of or 1) > 1:
        raise ApiError(400, "a handoff carries one prompt and one sample", param=PARAM)
    if role == "prefill":
        if body.stream:
            raise ApiError(400, "a prefill handoff answers once: stream must be false", param="stream")
        return Transfer(role)
    return Transfer(role, params.prompt_token_ids, _handed_over(state, params, body.model), params.store_wait_seconds)


def _handed_over(state: ServerState, params: KVTransferParams, model: str | None) -> int:
    """Prompt tokens whose blocks the prefill engine stored, or 0 when its hashes are not this engine's
    (another model, cache salt or adapter: nothing in the store is this engine's to load). A request
    under a LoRA adapter hashes from that adapter's root, as the engine does."""
    info = state.engine.info
    root = state.engine.adapter_roots.get(model, info.hash_root)
    hashes: list = []
    BlockHasher(info.block_size, root).extend(hashes, params.prompt_token_ids)
    stored = (params.block_hashes or [])[:params.num_stored_blocks]
    if [h.hex() for h in hashes[:len(stored)]] != stored:
        return 0
    return len(stored) * info.block_size


def prefill_answer(state: ServerState, first: RequestOutput, final: RequestOutput) -> dict:
    """The prefill engine's `kv_transfer_params`: what the decode engine needs, sent on as it is."""
    handoff = final.kv_transfer
    assert handoff is not None, "a finished prefill handoff always says what it stored"
    return {"do_remote_prefill": True, "prompt_token_ids": first.prompt_token_ids,
            "block_hashes": [h.hex() for h in handoff.block_hashes], "num_stored_blocks": handoff.num_stored,
            "first_token_id": first.new_token_ids[0] if first.new_token_ids else None,
            "store_wait_seconds": handoff.wait_seconds}


def count_prefill(state: ServerState, final: RequestOutput) -> None:
    handoff = final.kv_transfer
    stored = handoff.num_stored
    outcome = "stored_all" if stored == len(handoff.block_hashes) else "stored_part" if stored else "stored_none"
    state.metrics.handoff("prefill", outcome, {"stored": stored * state.engine.info.block_size},
                          handoff.wait_seconds)


def decode_usage(transfer: Transfer, first: RequestOutput, final: RequestOutput | None = None) -> dict:
    """The handoff in a decode engine's `usage`: tokens handed over, those of them recomputed (a block
    missing or corrupt in the store), and the transfer's time: the prefill engine's wait for its
    store writes, and this engine's load (known at the end: `final`'s timeline)."""
    loaded = min(transfer.handed_over_tokens, first.num_cached_tokens)
    usage = {"handed_over_tokens": transfer.handed_over_tokens,
             "recomputed_tokens": transfer.handed_over_tokens - loaded,
             "store_wait_seconds": round(transfer.store_wait_seconds, 6)}
    if final is not None and final.timeline is not None:
        usage["load_seconds"] = round(final.timeline.breakdown()["load"], 6)
    return usage


def count_decode(state: ServerState, transfer: Transfer, first: RequestOutput) -> None:
    usage = decode_usage(transfer, first)
    outcome = "recomputed" if usage["recomputed_tokens"] or not transfer.handed_over_tokens else "loaded"
    state.metrics.handoff("decode", outcome, {"handed_over": usage["handed_over_tokens"],
                                              "recomputed": usage["recomputed_tokens"]})
