"""`kvstrata router --pd-disaggregation`: each request computed by a prefill engine, then served by a
decode engine that loads the prompt's KV from the store they share (docs/design/disaggregation.md).

    client -> router -> prefill engine   the body, not streamed, plus kv_transfer_params
                                         {"do_remote_decode": true}; its answer (one token) carries
                                         kv_transfer_params: the prompt's token ids and the hashes of
                                         the blocks it put in the store before answering
                     -> decode engine    the client's body plus those kv_transfer_params, as they came;
                                         its answer (or stream) is relayed to the client unchanged

Nothing is pinned anywhere between the two legs: the prefill engine's request has ended (its blocks
are cached, evictable), and the store's records are content-addressed, so a decode engine that finds
one missing or corrupt recomputes it. Hence every failure has a cheap way out:

    a prompt of at most --local-prefill-tokens tokens the chosen decode engine lacks: prefilled there (no
        handoff: a short prompt's handoff costs its first token more than its prefill costs the streams)
    prefill engine down or refusing (503)  the next prefill engine; none left: colocated on a decode engine
    prefill past --handoff-timeout         colocated on a decode engine (the prefill's request is aborted)
    a request that is not one prompt and one sample (n, best_of, several prompts): colocated
    decode engine down before its answer   the next decode engine (the KV is in the store for any of them)
    decode engine dying mid-stream         the stream ends with an error event and [DONE]; it is taken out
    the client leaving, at any point       the engine leg under way is closed, which aborts it there
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kvstrata.core.disconnects import ClientGone, unless_disconnected
from kvstrata.router.fleet import Fleet
from kvstrata.router.forwarding import CLIENT_GONE, forward, read_body
from kvstrata.router.policies import NoEngineAvailable, RoutedPrompt

logger = logging.getLogger(__name__)

# What a prefill engine is not sent: it answers once, with one token (it sets max_tokens itself).
NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "max_completion_tokens", "max_tokens")


async def route_pd(fleet: Fleet, request: Request, path: str) -> Response:
    raw, body = await read_body(request)
    prompt = await fleet.routed_prompt(path, body)
    metrics = fleet.metrics
    try:
        reason = _not_handed_over(path, body)
        params = None
        if reason is None and _prefilled_locally(fleet, prompt):
            metrics.handoffs.labels("prefilled_locally").inc()
            return await forward(fleet, request, path, raw, prompt, fleet.colocated)
        if reason is None:
            params, reason = await _prefill(fleet, request, path, body, prompt)
            if isinstance(params, Response):          # the request's own error: the client's to see
                return params
        if reason is not None:
            metrics.fallbacks.labels(reason).inc()
            metrics.handoffs.labels("fell_back").inc()
            return await forward(fleet, request, path, raw, prompt, fleet.colocated)
        if await request.is_disconnected():
            raise ClientGone("between")
        started = time.monotonic()
        response = await forward(fleet, request, path, json.dumps({**body, "kv_transfer_params": params}).encode(),
                                 prompt, fleet.decode)
        if isinstance(response, StreamingResponse):      # forward() returned on the stream's first bytes
            metrics.transfer_seconds.labels("decode_first_bytes").observe(time.monotonic() - started)
        metrics.handoffs.labels("handed_over").inc()
        return response
    except ClientGone as gone:
        metrics.aborts.labels(gone.args[0] if gone.args else "decode").inc()
        metrics.handoffs.labels("client_gone").inc()
        return Response(status_code=CLIENT_GONE)


def _not_handed_over(path: str, body: Any) -> str | None:
    """Why a request is served colocated instead (None: it is handed over)."""
    if not isinstance(body, dict) or "kv_transfer_params" in body:
        return "unsupported"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "samples"
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
            and len(prompt) > 1:
        return "prompts"
    return None


def _prefilled_locally(fleet: Fleet, prompt: RoutedPrompt) -> bool:
    """Whether the decode engine the request would go to lacks at most --local-prefill-tokens of its
    prompt (by the decode policy's predicted hit, as `forward` will choose it)."""
    limit = fleet.config.local_prefill_tokens
    if not limit or prompt.num_tokens <= 0:
        return False
    try:
        decision = fleet.colocated.policy.route(prompt, fleet.colocated.views)
    except NoEngineAvailable:
        return False
    return prompt.num_tokens - decision.predicted_hit_tokens <= limit


async def _prefill(fleet: Fleet, request: Request, path: str, body: dict,
                   prompt: RoutedPrompt) -> tuple[dict | Response | None, str | None]:
    """(the prefill engine's kv_transfer_params, None), or (the answer to give the client, None) for a
    request the engine refused as bad, or (None, why to serve it colocated instead)."""
    sent = json.dumps({**{k: v for k, v in body.items() if k not in NOT_FOR_PREFILL},
                       "kv_transfer_params": {"do_remote_decode": True}}).encode()
    timeout = httpx.Timeout(fleet.config.handoff_timeout, connect=fleet.config.connect_timeout)
    group = fleet.prefill
    for _ in group.views:
        try:
            view, decision = fleet.choose(prompt, group)
        except NoEngineAvailable:
            return None, "prefill_down"
        sent_tokens = prompt.num_tokens - decision.predicted_hit_tokens
        view.sent_requests += 1
        view.sent_tokens += sent_tokens
        started, outcome = time.monotonic(), "ok"
        try:
            reply = await unless_disconnected(request.is_disconnected, fleet.client.post(
                f"{view.url}{path}", content=sent, headers=fleet.headers_for_engine(request.headers), timeout=timeout))
        except ClientGone:
            outcome = "client_gone"
            raise ClientGone("prefill") from None
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            outcome = "retried"
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        except httpx.TimeoutException:
            outcome = "timeout"
            logger.warning("prefill on %s took over %.0fs: served colocated", view.url, fleet.config.handoff_timeout)
            return None, "prefill_timeout"
        finally:
            view.sent_requests -= 1
            view.sent_tokens -= sent_tokens
            fleet.metrics.requests.labels(view.url, outcome).inc()
        if reply.status_code == 503:
            fleet.take_out(view, "it answered 503")
            continue
        return _prefill_answer(fleet, view.url, reply, prompt, time.monotonic() - started)
    return None, "prefill_down"


def _prefill_answer(fleet: Fleet, url: str, reply: httpx.Response, prompt: RoutedPrompt,
                    seconds: float) -> tuple[dict | Response | None, str | None]:
    if reply.status_code >= 500:
        return None, "prefill_failed"
    answer = reply.json()
    if reply.status_code >= 400:
        if answer.get("error", {}).get("param") == "kv_transfer_params":      # not a prefill engine
            logger.warning("%s refused a prefill handoff: %s", url, answer["error"].get("message"))
            return None, "prefill_refused"
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type")), None
    params = answer.get("kv_transfer_params")
    if not params:
        return None, "prefill_refused"
    metrics = fleet.metrics
    metrics.prefill_seconds.observe(seconds)
    metrics.transfer_seconds.labels("store_wait").observe(params.get("store_wait_seconds", 0.0))
    metrics.handed_over_tokens.inc(params.get("num_stored_blocks", 0) * prompt.block_size)
    return params, None
