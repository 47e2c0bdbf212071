"""Engine configuration: small frozen dataclasses, composed into `EngineConfig`.

Each component receives the smallest piece that serves it (the scheduler gets
`SchedulerConfig`, the tier manager `CacheConfig`). Values learned at run time
(number of device blocks, EOS ids) are returned by the code that learns them and
passed on as arguments; they are never written back into a config.

Every field carries a `help` string in its metadata: the CLI turns fields into
flags, so the flags cannot drift from what exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "gguf")
LOAD_FORMATS = ("auto", "dummy")
POLICIES = ("fcfs", "priority", "lpm")
WRITE_POLICIES = ("write_back", "write_through")
DISAGGREGATION_MODES = ("both", "prefill", "decode")
ALLOCATORS = ("auto", "jemalloc", "glibc")
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"     # vLLM's switch for loading adapters at run time
SPECULATIVE_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
               "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def cache_dir() -> Path:
    """Where kvstrata keeps converted models and the disk store: $KVSTRATA_CACHE_DIR or ~/.cache/kvstrata."""
    return Path(os.environ.get("KVSTRATA_CACHE_DIR") or Path.home() / ".cache" / "kvstrata")


def parse_size(text: str | int) -> int:
    """'512MiB' -> 536870912. Accepts plain byte counts and decimal or binary units."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 512MiB, 2GiB or 1000000")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    """1073741824 -> '1GiB', 1500 -> '1500': the largest binary unit that divides exactly."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _opt(default, help: str, choices: tuple[str, ...] | None = None, size: bool = False):
    return field(default=default, metadata={"help": help, "choices": choices, "size": size})


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _opt(None, "GGUF file or Hugging Face folder (config.json + safetensors); with "
                                   "--load-format dummy, a config.json, its folder or a shipped shape "
                                   "(llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, qwen2.5-1.5b, qwen2.5-7b); "
                                   "default: the embedded SmolLM2-135M-Instruct")
    load_format: str = _opt("auto", "auto: the weights of --model; dummy: seeded random weights at --model's "
                                    "real shape, for speed measurements (the outputs are noise)", LOAD_FORMATS)
    tokenizer: str | None = _opt(None, "GGUF file or Hugging Face folder to take the tokenizer and chat template "
                                       "from (default: the model's own; with --load-format dummy, the embedded "
                                       "SmolLM2's)")
    dtype: str = _opt("auto", "activation and KV dtype; auto picks the fastest for the weight format and device "
                              "(a GGUF at its own bits: bfloat16 on any CPU; float weights: bfloat16 where the CPU "
                              "has native bf16, else float32)", DTYPES)
    device: str = _opt("auto", "where the model runs; auto takes CUDA when present", DEVICES)
    threads: int | None = _opt(None, "torch CPU threads (default: torch's choice)")
    quantization: str = _opt("auto", "weights of the linear layers: auto (a GGUF file's own bits where "
                                     "kvstrata's kernel runs them: on CPU, without --compile, unless --dtype float32 "
                                     "asks for float32 math; else none), none (the dtype's own), int8 (CPU only: int8 "
                                     "weights, activations quantized per call) or gguf (CPU only: a GGUF file's "
                                     "Q4_0 / Q4_1 / Q8_0 / Q6_K / BF16 matrices at their own bits, other types "
                                     "widened to the dtype with a warning)", QUANTIZATIONS)
    compile: bool = _opt(False, "torch.compile the decoder layers around attention at load (fewer ops per "
                                "step; the first start compiles for about a minute, later ones read the cache)")
    batch_invariant: bool = _opt(False, "a bf16/fp16 model's greedy outputs independent of batching and "
                                        "caching (every row's attention in the paged kernel, norm statistics "
                                        "in float64, a lone row padded to two; decode steps and prefills 0.9-1.3x "
                                        "plain bf16's time, no cascade attention); float32 and int8 are so "
                                        "already")

    def validate(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {self.quantization!r}")
        _require(self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        _require(self.load_format in LOAD_FORMATS,
                 f"load_format must be one of {', '.join(LOAD_FORMATS)}, not {self.load_format!r}")
        _require(self.threads is None or self.threads >= 1, "threads must be at least 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV block")
    kv_cache_memory: int = _opt(1024**3, "bytes of device memory for the KV cache (e.g. 512MiB, 2GiB)",
                                size=True)
    num_device_blocks: int | None = _opt(None, "exact number of device KV blocks "
                                               "(overrides --kv-cache-memory)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV of prefixes computed before")
    cache_salt: str = _opt("", "salt mixed into every block hash (isolates tenants sharing a store)")
    host_cache_memory: int = _opt(0, "bytes of host memory for the host KV tier (0: no host tier)", size=True)
    num_host_blocks: int | None = _opt(None, "exact number of host KV blocks (overrides --host-cache-memory)")
    store: str = _opt("none", "KV store below host memory: none, disk, redis://host:port/db, or a Redis "
                              "Cluster: redis+cluster://host:port,host:port,...")
    store_path: str | None = _opt(None, "folder of the disk store (default: $KVSTRATA_CACHE_DIR/store, "
                                        "else ~/.cache/kvstrata/store)")
    store_capacity: int = _opt(20 * 1024**3, "byte budget of the disk store (least recently read deleted first)",
                               size=True)
    store_timeout: float = _opt(2.0, "seconds a store lookup or load may take before it counts as a miss")
    write_policy: str = _opt("write_back", "write_back: offload a block when it is evicted; write_through: as "
                                           "soon as it is full", WRITE_POLICIES)
    persist: bool = _opt(True, "also write full blocks to the store while the engine is idle and at shutdown, "
                               "so the cache survives a restart")
    reserve_ratio_init: float = _opt(0.7, "share of running requests' remaining max_tokens kept "
                                          "free at admission, right after start or a preemption")
    reserve_ratio_min: float = _opt(0.1, "floor the reserved share decays to")
    reserve_ratio_decay: float = _opt(0.001, "decay of the reserved share per non-empty step")
    reserve_clip_tokens: int = _opt(4096, "remaining max_tokens counted per request at most")
    swa_full: bool = _opt(False, "keep every sliding-window layer's KV at full length (llama.cpp's --swa-full); "
                                 "by default a hybrid model's sliding layers keep only their window on the device")

    def validate(self) -> None:
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, not {self.block_size}")
        _require(self.kv_cache_memory > 0, "kv_cache_memory must be positive")
        _require(self.num_device_blocks is None or self.num_device_blocks >= 1,
                 "num_device_blocks must be at least 1")
        _require(0.0 <= self.reserve_ratio_min <= self.reserve_ratio_init <= 1.0,
                 "need 0 <= reserve_ratio_min <= reserve_ratio_init <= 1")
        _require(self.host_cache_memory >= 0, "host_cache_memory must not be negative")
        _require(self.num_host_blocks is None or self.num_host_blocks >= 0, "num_host_blocks must not be negative")
        _require(self.store in ("none", "disk") or self.store.startswith(("redis://", "redis+cluster://")),
                 f"store must be none, disk, a redis:// or a redis+cluster:// URL, not {self.store!r}")
        _require(self.store_path is None or self.store == "disk",
                 f"store_path names a disk store folder, but the store is {self.store!r}")
        _require(self.store_capacity > 0, "store_capacity must be positive")
        _require(self.store_timeout > 0, "store_timeout must be positive")
        _require(self.write_policy in WRITE_POLICIES,
                 f"write_policy must be one of {', '.join(WRITE_POLICIES)}, not {self.write_policy!r}")
        _require(self.reserve_ratio_decay >= 0.0, "reserve_ratio_decay must not be negative")
        _require(self.reserve_clip_tokens >= 0, "reserve_clip_tokens must not be negative")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _opt(64, "most requests running at once")
    max_num_batched_tokens: int = _opt(512, "token budget of one step (prefill chunks plus decodes)")
    max_model_len: int | None = _opt(None, "longest sequence (prompt plus output) accepted; default: the "
                                           "model's max_position_embeddings, and never more")
    policy: str = _opt("fcfs", "order of waiting requests: fcfs, priority (lower value first) "
                               "or lpm (longest cached prefix first)", POLICIES)
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps")
    max_tpot_ms: float = _opt(150.0, "while requests decode, cut each step's prefill to what the engine's "
                                     "measured step cost says fits in this many ms (at least "
                                     "min_prefill_tokens; more when over 4 requests wait per decoding "
                                     "one); 0: no cut")
    min_prefill_tokens: int = _opt(64, "prefill tokens a step may always take under max_tpot_ms, so that "
                                       "waiting prompts move on")

    def validate(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs must be at least 1")
        _require(self.max_tpot_ms >= 0, f"max_tpot_ms must be 0 (off) or positive, not {self.max_tpot_ms}")
        _require(self.min_prefill_tokens >= 1, "min_prefill_tokens must be at least 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be at least 1")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2")
        _require(self.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        _require(self.enable_chunked_prefill or self.max_model_len is None
                 or self.max_num_batched_tokens >= self.max_model_len,
                 "without chunked prefill, max_num_batched_tokens must be at least max_model_len "
                 f"({self.max_num_batched_tokens} < {self.max_model_len})")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config JSON`, vLLM's field names): each step proposes up to
    `num_speculative_tokens` draft tokens per request and verifies them in the same forward.

    ngram (prompt lookup): the drafts are the tokens that followed the last occurrence of the
    request's latest n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its own prompt
    and output. Build it with `parse`, which fills vLLM's defaults and says what is wrong."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int | None = None    # no drafts while this many requests or more are running

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON or `LLM(speculative_config=dict)`; None stays None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON ({exc}); write e.g. "
                                 f"'{SPECULATIVE_EXAMPLE}'") from None
        _require(isinstance(value, dict), f"speculative_config must be a JSON object such as '{SPECULATIVE_EXAMPLE}'")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        _require(not unknown, f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                              f"known: {', '.join(known)}")
        _require("num_speculative_tokens" in value, "speculative_config needs num_speculative_tokens, e.g. "
                                                   f"'{SPECULATIVE_EXAMPLE}'")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            number = value.get(name)
            _require(number is None or (isinstance(number, int) and not isinstance(number, bool)),
                     f"speculative_config: {name} must be an integer, not {number!r}")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:            # vLLM's defaults
            low = high = 5
        values = dict(value, prompt_lookup_min=high if low is None else low, prompt_lookup_max=low if high is None
                      else high)
        return cls(**values).validate()

    def validate(self) -> SpeculativeConfig:
        _require(self.method in SPECULATIVE_METHODS, f"speculative_config: method must be one of "
                                                     f"{', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        _require(1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                 f"speculative_config: num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                 f"not {self.num_speculative_tokens}")
        _require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                 f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, not "
                 f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        _require(self.disable_by_batch_size is None or self.disable_by_batch_size >= 2,
                 "speculative_config: disable_by_batch_size must be at least 2")
        return self


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's own options; the engine never sees them."""

    host: str = _opt("127.0.0.1", "address to bind (127.0.0.1: this machine only)")
    port: int = _opt(8000, "TCP port")
    api_key: str | None = _opt(None, "require 'Authorization: Bearer KEY' on every route but /health (default: "
                                     "open)")
    metrics_without_key: bool = _opt(False, "with --api-key, leave /metrics open (for a Prometheus that cannot "
                                            "send the key)")
    max_body_bytes: int = _opt(8 << 20, "largest request body in bytes; a larger one gets 413 before it is read")
    body_timeout: float = _opt(60.0, "seconds a client has to send its whole request body (408 past it, or "
                                     "after 10 s with no byte)")
    served_model_name: str | None = _opt(None, "model name clients must send (default: the model's own)")
    max_queue: int = _opt(256, "requests in flight (running or waiting) before new ones get 503")
    timelines_kept: int = _opt(4096, "timelines of the last requests kept for GET /v1/timelines (each a few KiB; "
                                     "the oldest is dropped first)")
    kv_events_kept: int = _opt(65536, "KV cache events kept for routers polling GET /v1/kv_events (~160 bytes "
                                      "each); a router further behind gets a snapshot of every hash held instead")
    allocator: str = _opt("auto", "the server's malloc: jemalloc returns freed memory to the OS where glibc's heaps "
                                  "fragment over hours (make install unpacks it into the venv); auto: jemalloc "
                                  "where found, else glibc", ALLOCATORS)
    shutdown_timeout: float = _opt(30.0, "seconds in-flight requests get to finish on SIGTERM/SIGINT")
    allowed_origins: str | None = _opt(None, "browser origins allowed to call the API (CORS), comma-separated, "
                                             "or *; default: none (no CORS headers)")
    otlp_traces_endpoint: str | None = _opt(None, "OpenTelemetry collector to send a trace of each request to "
                                                  "(OTLP over HTTP/protobuf, e.g. http://localhost:4318; "
                                                  "/v1/traces is added to a URL without a path); needs "
                                                  "pip install 'kvstrata[otel]'; default: off")
    disaggregation_mode: str = _opt("both", "prefill/decode disaggregation (`kvstrata router --pd-disaggregation`): "
                                            "prefill also takes requests whose KV it hands over through the "
                                            "store, decode also takes requests whose prompt KV is in the store; "
                                            "both: neither (ordinary serving); each role serves ordinary "
                                            "requests too", DISAGGREGATION_MODES)

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in (self.allowed_origins or "").split(",") if o.strip())

    def validate(self) -> ServerConfig:
        _require(0 <= self.port <= 65535, f"port must be in 0..65535, not {self.port}")
        _require(self.max_queue >= 1, "max_queue must be at least 1")
        _require(self.max_body_bytes >= 1024, "max_body_bytes must be at least 1024")
        _require(self.body_timeout > 0, "body_timeout must be positive")
        _require(self.timelines_kept >= 1, "timelines_kept must be at least 1")
        _require(self.kv_events_kept >= 1, "kv_events_kept must be at least 1")
        _require(self.allocator in ALLOCATORS, f"allocator must be one of {', '.join(ALLOCATORS)}, not "
                 f"{self.allocator!r}")
        _require(self.shutdown_timeout >= 0, "shutdown_timeout must not be negative")
        _require(self.otlp_traces_endpoint is None or self.otlp_traces_endpoint.startswith(("http://", "https://")),
                 f"otlp_traces_endpoint must be an http:// or https:// URL, not {self.otlp_traces_endpoint!r}")
        _require(self.disaggregation_mode in DISAGGREGATION_MODES, f"disaggregation_mode must be one of "
                 f"{', '.join(DISAGGREGATION_MODES)}, not {self.disaggregation_mode!r}")
        return self


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = _opt(False, "serve LoRA adapters (PEFT folders) on top of the base model; a request "
                                    "picks one by its `model` field")
    lora_modules: tuple[str, ...] = _opt((), "adapters to serve from the start, as NAME=PATH (PEFT's "
                                             "adapter_config.json + adapter_model.safetensors); implies --enable-lora")
    max_loras: int = _opt(4, "adapters held in memory at once: beyond them the least recently used one with "
                             "no request in flight is dropped and read again from disk when asked for; a "
                             "request whose adapter finds every slot busy waits, it is not refused")
    max_lora_rank: int = _opt(64, "the highest adapter rank accepted (a higher one is refused when loaded)")
    allow_runtime_lora_updating: bool = _opt(False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                                    "(with --enable-lora; so does VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                                                    "or true, as in vLLM); without it both are 404. Any client can "
                                                    "then make the server read a folder: confine them with "
                                                    "--lora-root")
    lora_root: tuple[str, ...] = _opt((), "folders an adapter loaded at run time must lie beneath once symlinks "
                                          "are resolved, one or more (the flag may repeat; default: anywhere the "
                                          "server can read); --lora-modules are the operator's own and not held "
                                          "to them")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def runtime_updating(self) -> bool:
        """Whether clients may load and unload adapters: --allow-runtime-lora-updating or vLLM's variable."""
        allowed = os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
        return self.enabled and (self.allow_runtime_lora_updating or allowed)

    def modules(self) -> dict[str, str]:
        """--lora-modules as name -> path; ValueError naming a malformed or repeated entry."""
        named: dict[str, str] = {}
        for entry in self.lora_modules:
            name, sep, path = entry.partition("=")
            _require(bool(sep and name.strip() and path.strip()), f"--lora-modules takes NAME=PATH, not {entry!r}")
            _require(name not in named, f"--lora-modules names {name!r} twice")
            named[name.strip()] = path.strip()
        return named

    def validate(self) -> None:
        self.modules()
        _require(self.max_loras >= 1, "max_loras must be at least 1")
        _require(1 <= self.max_lora_rank <= 1024, "max_lora_rank must be in [1, 1024]")
        _require(self.enabled or not self.allow_runtime_lora_updating,
                 "--allow-runtime-lora-updating needs --enable-lora")
        for root in self.lora_root:
            _require(os.path.isdir(root), f"--lora-root {root!r} is not a folder")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    audit_every_step: bool = _opt(False, "check block conservation and refcounts after every step")
    speculative_config: SpeculativeConfig | None = None     # None: no speculation (predicted outputs still draft)

    def validate(self) -> EngineConfig:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.lora.validate()
        if self.lora.enabled:
            _require(not self.model.compile, "--enable-lora does not run with --compile (adapters are applied "
                                             "outside the compiled graphs); drop one of them")
            _require(not self.model.batch_invariant, "--enable-lora does not run with --batch-invariant (an "
                                                     "adapter's rows are summed by group); drop one of them")
        if self.speculative_config is not None:
            self.speculative_config.validate()
        return self

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """Build from flat field names of any section: `EngineConfig.from_options(block_size=32, model=...)`."""
        sections = {}
        for name in ("model", "cache", "scheduler", "lora"):
            section_type = {f.name: f for f in dataclasses.fields(cls)}[name].default_factory
            fields = {f.name: f for f in dataclasses.fields(section_type)}
            values = {k: options.pop(k) for k in list(options) if k in fields}
            if values.get("store_path") is not None and values.get("store", "none") == "none":
                values["store"] = "disk"            # a store folder means the disk store
            sections[name] = section_type(**{k: parse_size(v) if fields[k].metadata.get("size") else
                                             tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        top = {k: options.pop(k) for k in list(options) if k in {f.name for f in dataclasses.fields(cls)}}
        if "speculative_config" in top:
            top["speculative_config"] = SpeculativeConfig.parse(top["speculative_config"])
        if options:
            raise ValueError(f"unknown option(s): {', '.join(sorted(options))}")
        return cls(**sections, **top).validate()
