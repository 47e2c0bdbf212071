"""The router's fleet: its configuration, the engines' views and the groups and policies over them,
the watchers that keep the views current (KV events, health), and its metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstrata.core.hashing import BlockHasher
from kvstrata.router.event_view import EventView
from kvstrata.router.policies import POLICIES, Decision, Policy, RoutedPrompt, make_policy

logger = logging.getLogger(__name__)

EVENTS_WAIT = 1.0          # seconds an engine holds a /v1/kv_events long-poll with nothing new
LATENCY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[str, ...]              # colocated engines (none with prefill and decode engines)
    policy: str = "kv_aware"              # over the colocated engines, or over the prefill engines
    health_interval: float = 1.0          # seconds between health checks of an engine
    connect_timeout: float = 2.0
    request_timeout: float = 600.0        # longest wait for an engine's next bytes
    engine_api_key: str | None = None     # the engines' --api-key, for the router's own calls (events)
    api_key: str | None = None            # the router's own: clients send it, the engines get engine_api_key
    prefill: tuple[str, ...] = ()         # --pd-disaggregation: engines run with --disaggregation-mode prefill
    decode: tuple[str, ...] = ()          # ... and with --disaggregation-mode decode
    handoff_timeout: float = 120.0        # longest wait for a prefill engine's answer (its prefill and store writes)
    local_prefill_tokens: int = 0         # prompts with at most this many tokens a decode engine lacks: no handoff

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill or self.decode)

    @property
    def all_engines(self) -> tuple[str, ...]:
        return self.engines + self.prefill + self.decode

    def validate(self) -> RouterConfig:
        if self.disaggregated and (self.engines or not self.prefill or not self.decode):
            raise ValueError("--pd-disaggregation takes --prefill and --decode engines (at least one of each), "
                             "and no --engine")
        if not self.all_engines:
            raise ValueError("the router needs at least one --engine URL")
        for url in self.all_engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine {url!r} must be an http:// or https:// URL")
        if len(set(self.all_engines)) != len(self.all_engines):
            raise ValueError("the same engine URL was given twice")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if min(self.health_interval, self.connect_timeout, self.request_timeout, self.handoff_timeout) <= 0:
            raise ValueError("intervals and timeouts must be positive")
        if self.local_prefill_tokens < 0:
            raise ValueError(f"--local-prefill-tokens must be 0 (hand every prompt over) or positive, "
                             f"not {self.local_prefill_tokens}")
        return self


class PromptTokens:
    """The token ids an engine will see for a request body, from the same tokenizer and template.

    None for a body the router cannot read: the engine will refuse it, so where it goes matters not.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()       # one tokenizer object is not safe under concurrent calls

    async def __call__(self, path: str, body: Any) -> list[int] | None:
        """Off the event loop (a long prompt delays its own routing only)."""
        return await asyncio.to_thread(self._locked, path, body)

    def _locked(self, path: str, body: Any) -> list[int] | None:
        with self._lock:
            return self.ids(path, body)

    def ids(self, path: str, body: Any) -> list[int] | None:
        """The ids, on the caller's thread (one thread at a time)."""
        try:
            if path == "/v1/chat/completions":
                return self._chat(body["messages"])
            prompt = body["prompt"]
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):              # as the engine encodes it (kvstrata.engine.prompts)
                return self.tokenizer.encode(prompt, add_special_tokens=True)
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
        # Prefill/decode disaggregation (kvstrata.router.disaggregated)
        self.handoffs = Counter("kvstrata_router_handoffs", "Requests under --pd-disaggregation by outcome "
                                "(handed_over: prefill then decode; prefilled_locally: a prompt of at most "
                                "--local-prefill-tokens new tokens, prefilled by its decode engine; fell_back: served "
                                "colocated on a decode engine; client_gone: the client left)", ["outcome"],
                                registry=self.registry)
        self.fallbacks = Counter("kvstrata_router_handoff_fallbacks", "Requests served colocated instead of handed "
                                 "over, by reason", ["reason"], registry=self.registry)
        self.aborts = Counter("kvstrata_router_handoff_aborts", "Clients gone during a handoff, by phase (prefill, "
                              "between, decode: the decode engine's load or its stream)", ["phase"],
                              registry=self.registry)
        self.handed_over_tokens = Counter("kvstrata_router_handed_over_tokens", "Prompt tokens whose KV prefill "
                                          "engines put in the store for a decode engine", registry=self.registry)
        self.prefill_seconds = Histogram("kvstrata_router_prefill_seconds", "A prefill engine's answer: its "
                                         "prefill and its store writes", buckets=LATENCY_BUCKETS,
                                         registry=self.registry)
        self.transfer_seconds = Histogram("kvstrata_router_transfer_seconds", "Handoff transfer time: the prefill "
                                          "engine's wait for its store writes, then the decode engine's first "
                                          "bytes (its load, its last prompt block, its first token)",
                                          ["part"], buckets=LATENCY_BUCKETS, registry=self.registry)


@dataclass
class EngineGroup:
    """Engines that play one part, and the policy that picks among them."""

    views: list[EventView]
    policy: Policy


class Fleet:
    """The engines' views, the policies over them, and what keeps the views current.

    Colocated, one group serves everything. Disaggregated, `prefill` engines (the configured policy)
    take the prompt and `decode` engines (least loaded, with the affinity of a conversation's earlier
    turns: prefix_affinity) the rest; decode engines also serve what is not handed over.
    """

    def __init__(self, config: RouterConfig, policy: Policy, prompt_tokens: PromptTokens):
        self.config, self.prompt_tokens = config, prompt_tokens
        self.views = [EventView(url) for url in config.all_engines]
        by_url = {view.url: view for view in self.views}
        if config.disaggregated:
            self.prefill = EngineGroup([by_url[url] for url in config.prefill], policy)
            self.decode = EngineGroup([by_url[url] for url in config.decode], make_policy("prefix_affinity"))
            self.colocated = self.decode
        else:
            self.colocated = EngineGroup(self.views, policy)
        self.metrics = RouterMetrics(config.all_engines)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout,
                                                               connect=config.connect_timeout))
        self._own_headers = {"authorization": f"Bearer {config.engine_api_key}"} if config.engine_api_key else {}

    def headers_for_engine(self, client: Mapping[str, str]) -> dict[str, str]:
        """A client's headers as an engine gets them: its key passed on, unless the router has a key of
        its own (then the client's key is the router's, and the engines get --engine-api-key)."""
        headers = {name: value for name, value in client.items()
                   if name.lower() in ("authorization", "content-type", "accept")}
        if self.config.api_key is not None:
            headers = {name: value for name, value in headers.items() if name.lower() != "authorization"}
            headers.update(self._own_headers)
        return headers
        self._watchers: list[asyncio.Task] = []

    # ---- routing --------------------------------------------------------------------------------
    async def routed_prompt(self, path: str, body: Any) -> RoutedPrompt:
        """The request as the policy sees it, hashed with the chain root the engines publish: a LoRA
        adapter's own root when `model` names one an engine serves (its blocks are keyed by it), else
        the base model's."""
        informed = next((v for v in self.views if v.hash_root is not None), None)
        token_ids = await self.prompt_tokens(path, body)
        if informed is None or token_ids is None:
            return RoutedPrompt(len(token_ids or ()), [], informed.block_size if informed else 1)
        model = body.get("model") if isinstance(body, dict) else None
        serving = next((v for v in self.views if model in v.adapter_roots), None)
        root = serving.adapter_roots[model] if serving is not None else informed.hash_root
        hashes: list = []
        BlockHasher(informed.block_size, root).extend(hashes, token_ids)
        return RoutedPrompt(len(token_ids), hashes, informed.block_size)

    def choose(self, prompt: RoutedPrompt, group: EngineGroup) -> tuple[EventView, Decision]:
        decision = group.policy.route(prompt, group.views)
        view = group.views[decision.engine]
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


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer (with its chat template) the engines load for `model` (default: the embedded GGUF)."""
    from transformers import AutoTokenizer

    from kvstrata.core.config import cache_dir
    from kvstrata.model.loader import default_model_path, file_sha256
    from kvstrata.model.sources import gguf_convert

    path = Path(model).expanduser() if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        path = gguf_convert.ensure_converted(path, cache_dir(), file_sha256(path))
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither a .gguf file nor a model folder")
    return AutoTokenizer.from_pretrained(path)


def build_fleet(config: RouterConfig, tokenizer: Any) -> Fleet:
    return Fleet(config.validate(), make_policy(config.policy), PromptTokens(tokenizer))
