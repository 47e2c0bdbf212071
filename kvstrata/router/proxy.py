"""`kvstrata router`: one OpenAI-compatible endpoint over many `kvstrata serve` engines.

    client -> router: tokenize as the engines do (tokenizer, chat template), hash the blocks with the
              engines' chain root (it carries the cache salt), ask the policy (kvstrata.router.policies)
           -> engine: the request body, unchanged; the reply (or the stream) is relayed unchanged

Per engine, a watcher long-polls `/v1/kv_events` into an `EventView` (kvstrata.router.event_view) and
checks `/health`. An engine that does not answer, answers 503 or fails its health check is taken
out: it gets no new requests, and the request that found it out is sent to another engine (a
stream that already started ends with an error event instead: its tokens cannot be taken back).
It comes back at its next good health check, with a snapshot of what it holds.

/metrics counts requests routed per engine and outcome, prompt tokens routed and the tokens the
policy predicted its caches would cover.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvstrata.core.hashing import BlockHasher
from kvstrata.router.event_view import EventView
from kvstrata.router.policies import POLICIES, Decision, NoEngineAvailable, Policy, RoutedPrompt, make_policy

logger = logging.getLogger(__name__)

ENGINE_HEADER = "x-kvstrata-engine"      # on every routed reply: the engine that served it
EVENTS_WAIT = 1.0          # seconds an engine holds a /v1/kv_events long-poll with nothing new


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[str, ...]
    policy: str = "kv_aware"
    health_interval: float = 1.0          # seconds between health checks of an engine
    connect_timeout: float = 2.0
    request_timeout: float = 600.0        # longest wait for an engine's next bytes
    engine_api_key: str | None = None     # the engines' --api-key, for the router's own calls (events)

    def validate(self) -> RouterConfig:
        if not self.engines:
            raise ValueError("the router needs at least one --engine URL")
        for url in self.engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--engine {url!r} must be an http:// or https:// URL")
        if len(set(self.engines)) != len(self.engines):
            raise ValueError("the same --engine was given twice")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.health_interval <= 0 or self.connect_timeout <= 0 or self.request_timeout <= 0:
            raise ValueError("intervals and timeouts must be positive")
        return self


class PromptTokens:
    """The token ids an engine will see for a request body, from the same tokenizer and template.

    None for a body the router cannot read: the engine will refuse it, so where it goes matters not.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, path: str, body: Any) -> list[int] | None:
        try:
            if path == "/v1/chat/completions":
                return self._chat(body["messages"])
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt, add_special_tokens=False)
            return [int(t) for t in prompt]
        except Exception:       # noqa: BLE001 - any unreadable body is the engine's to refuse
            return None

    def _chat(self, messages: list[dict]) -> list[int]:
        rendered = []
        for message in messages:
            content = message.get("content") or ""
            if isinstance(content, list):
                content = "".join(part["text"] for part in content)
            role = "system" if message["role"] == "developer" else message["role"]
            rendered.append({"role": role, "content": content})
        text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)


class RouterMetrics:
    def __init__(self, engines: Sequence[str]):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvstrata_router_requests", "Requests routed, by engine and outcome",
                                ["engine", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("kvstrata_router_prompt_tokens", "Prompt tokens routed, by engine",
                                     ["engine"], registry=self.registry)
        self.predicted_hits = Counter("kvstrata_router_predicted_hit_tokens",
                                      "Prompt tokens the policy predicted the engine's caches cover",
                                      ["engine"], registry=self.registry)
        self.up = Gauge("kvstrata_router_engine_up", "1 while the engine takes requests", ["engine"],
                        registry=self.registry)
        self.taken_out = Counter("kvstrata_router_engine_failures", "Times an engine was taken out",
                                 ["engine"], registry=self.registry)
        for url in engines:
            self.up.labels(url).set(0)


class Fleet:
    """The engines' views, the policy over them, and what keeps the views current."""

    def __init__(self, config: RouterConfig, policy: Policy, prompt_tokens: PromptTokens):
        self.config, self.policy, self.prompt_tokens = config, policy, prompt_tokens
        self.views = [EventView(url) for url in config.engines]
        self.metrics = RouterMetrics(config.engines)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout,
                                                               connect=config.connect_timeout))
        self._own_headers = {"authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else {}
        self._watchers: list[asyncio.Task] = []

    # ---- routing --------------------------------------------------------------------------------
    def routed_prompt(self, path: str, body: Any) -> RoutedPrompt:
        """The request as the policy sees it, hashed with the chain root the engines publish."""
        informed = next((v for v in self.views if v.hash_root is not None), None)
        token_ids = self.prompt_tokens(path, body)
        if informed is None or token_ids is None:
            return RoutedPrompt(len(token_ids or ()), [], informed.block_size if informed else 1)
        hashes: list = []
        BlockHasher(informed.block_size, informed.hash_root).extend(hashes, token_ids)
        return RoutedPrompt(len(token_ids), hashes, informed.block_size)

    def choose(self, prompt: RoutedPrompt) -> tuple[EventView, Decision]:
        decision = self.policy.route(prompt, self.views)
        view = self.views[decision.engine]
        self.metrics.prompt_tokens.labels(view.url).inc(prompt.num_tokens)
        self.metrics.predicted_hits.labels(view.url).inc(decision.predicted_hit_tokens)
        return view, decision

    def take_out(self, view: EventView, reason: str) -> None:
        if view.available:
            logger.warning("engine %s taken out: %s", view.url, reason)
            self.metrics.taken_out.labels(view.url).inc()
            view.out_since = time.monotonic()
        view.available = False
        self.metrics.up.labels(view.url).set(0)

    # ---- watching -------------------------------------------------------------------------------
    def start(self) -> None:
        self._watchers = [asyncio.create_task(self._watch(view)) for view in self.views]

    async def stop(self) -> None:
        for task in self._watchers:
            task.cancel()
        for task in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()

    async def _watch(self, view: EventView) -> None:
        """Health checks every interval; between them, the event long-poll; any failure: out. An
        engine taken out comes back after a good health check at least an interval later."""
        checked, interval = 0.0, self.config.health_interval
        while True:
            try:
                rest = view.out_since + interval - time.monotonic()
                if not view.available and rest > 0:
                    await asyncio.sleep(rest)
                    continue
                if not view.available or time.monotonic() - checked >= interval:
                    health = await self.client.get(f"{view.url}/health", timeout=self.config.health_interval * 2)
                    checked = time.monotonic()
                    if health.status_code != 200:
                        self.take_out(view, f"/health answered {health.status_code}")
                        await asyncio.sleep(self.config.health_interval)
                        continue
                reply = await self.client.get(f"{view.url}/v1/kv_events",
                                              params={**view.query(), "timeout": EVENTS_WAIT},
                                              headers=self._own_headers,
                                              timeout=EVENTS_WAIT + self.config.connect_timeout + 5)
                reply.raise_for_status()
                view.apply(reply.json())
                if not view.available and checked > view.out_since:     # healthy since it was taken out
                    logger.info("engine %s is in (%d cached blocks)", view.url, view.num_held)
                    view.available = True
                    self.metrics.up.labels(view.url).set(1)
            except (httpx.HTTPError, ValueError, KeyError, AssertionError) as exc:
                self.take_out(view, f"{type(exc).__name__}: {exc}")
                view.instance = None            # what it held may be gone: start again from a snapshot
                await asyncio.sleep(self.config.health_interval)
                checked = 0.0


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "overloaded_error" if status == 503 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def _error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "internal_error", "param": None, "code": "engine_failed"}}
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: value for name, value in request.headers.items()
            if name.lower() in ("authorization", "content-type", "accept")}


def create_router_app(fleet: Fleet) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        fleet.start()
        yield
        await fleet.stop()

    app = FastAPI(title="kvstrata router", lifespan=lifespan)
    app.state.fleet = fleet

    @app.get("/health")
    async def health():
        engines = {view.url: view.available for view in fleet.views}
        status = 200 if any(engines.values()) else 503
        return JSONResponse({"status": "ok" if status == 200 else "no engine available", "engines": engines},
                            status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(fleet.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return await _forward_get(fleet, request, "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        return await _forward_get(fleet, request, f"/v1/models/{model_id}")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _route(fleet, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _route(fleet, request, "/v1/completions")

    return app


async def _forward_get(fleet: Fleet, request: Request, path: str) -> Response:
    for view in [v for v in fleet.views if v.available]:
        try:
            reply = await fleet.client.get(f"{view.url}{path}", headers=_forwarded_headers(request))
        except httpx.TransportError as exc:
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))
    return _error(503, "no engine is available", "no_engine_available")


async def _route(fleet: Fleet, request: Request, path: str) -> Response:
    """Send the request to the policy's engine; if that one is down or refuses, to the next choice."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    prompt = fleet.routed_prompt(path, body)
    for _ in fleet.views:
        try:
            view, decision = fleet.choose(prompt)
        except NoEngineAvailable:
            break
        sent_tokens = prompt.num_tokens - decision.predicted_hit_tokens
        view.sent_requests += 1
        view.sent_tokens += sent_tokens

        def settle(outcome: str, view: EventView = view, sent_tokens: int = sent_tokens) -> None:
            view.sent_requests -= 1
            view.sent_tokens -= sent_tokens
            fleet.metrics.requests.labels(view.url, outcome).inc()

        try:
            upstream = await fleet.client.send(
                fleet.client.build_request("POST", f"{view.url}{path}", content=raw,
                                           headers=_forwarded_headers(request)), stream=True)
        except httpx.TransportError as exc:
            settle("retried")
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        if upstream.status_code == 503:
            await upstream.aclose()
            settle("retried")
            fleet.take_out(view, "it answered 503")
            continue
        media_type = upstream.headers.get("content-type", "")
        if media_type.startswith("text/event-stream"):
            # Started here, so that its `finally` (settle, close the upstream) runs even if the client
            # leaves before the reply begins: the event loop's async-generator hook closes it then.
            relay = _relay(fleet, view, upstream, settle)
            first = await anext(relay, b"")
            return StreamingResponse(_chain(first, relay), upstream.status_code, media_type=media_type,
                                     headers={ENGINE_HEADER: view.url})
        try:
            content = await upstream.aread()
        except httpx.TransportError as exc:        # it died before the answer was complete: ask another
            settle("retried")
            fleet.take_out(view, f"{type(exc).__name__}: {exc}")
            continue
        finally:
            await upstream.aclose()
        settle("ok" if upstream.status_code < 500 else "error")
        return Response(content, upstream.status_code, media_type=media_type or None,
                        headers={ENGINE_HEADER: view.url})
    return _error(503, "no engine is available; retry later", "no_engine_available")


async def _chain(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def _relay(fleet: Fleet, view: EventView, upstream: httpx.Response, settle) -> AsyncIterator[bytes]:
    """The engine's stream, byte for byte; if the engine fails mid-stream, an error event ends it."""
    outcome = "ok"
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        outcome = "error"
        fleet.take_out(view, f"its stream broke: {type(exc).__name__}: {exc}")
        yield _error_event(f"the engine serving this stream failed ({type(exc).__name__}); retry the request")
    finally:
        await upstream.aclose()
        settle(outcome)


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer (with its chat template) the engines load for `model` (default: the embedded GGUF)."""
    from transformers import AutoTokenizer

    from kvstrata.core.config import cache_dir
    from kvstrata.model import gguf_convert
    from kvstrata.model.loader import default_model_path, file_sha256

    path = Path(model).expanduser() if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        path = gguf_convert.ensure_converted(path, cache_dir(), file_sha256(path))
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither a .gguf file nor a model folder")
    return AutoTokenizer.from_pretrained(path)


def build_fleet(config: RouterConfig, tokenizer: Any) -> Fleet:
    return Fleet(config.validate(), make_policy(config.policy), PromptTokens(tokenizer))
