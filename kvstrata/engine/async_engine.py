"""`AsyncLLMEngine`: one thread steps an `LLMEngine` and serves many callers on an event loop.

The engine thread is the only owner of the engine's state (scheduler, tiers, pools, tokenizer).
Callers reach it only through its command queue (add, abort, `call`), and read only what it publishes
once per step: `snapshot` (kvstrata.engine.snapshots) and, when asked for, the KV-event log
(kvstrata.engine.kv_events); `adapters` (the LoRA adapters served) after each change. `info`, `prompts` (a
tokenizer of the callers' own) and `adapter_reader` are set once, when the engine is built.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from types import MappingProxyType
from typing import TypeVar

from kvstrata.core.hashing import BlockHash
from kvstrata.core.outputs import RequestOutput
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.adapters import AdapterReader
from kvstrata.engine.commands import Abort, AbortAll, AddRequest, Call, Command
from kvstrata.engine.heap_trim import HeapTrimmer
from kvstrata.engine.kv_events import EngineLoad, KVEventLog, KVEventRecorder
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.prompts import Prompt, PromptEncoder, Tokenized
from kvstrata.engine.snapshots import EngineInfo, EngineSnapshot
from kvstrata.model.adapters.lora import LoRAWeights

logger = logging.getLogger(__name__)

T = TypeVar("T")

PERSIST_BATCH = 16      # blocks an idle engine sends to the store between looks at its command queue
MAP_CHUNK_BYTES = 16 * 2**20   # KV pages an idle engine maps between looks (tens of ms of page faults)


class AsyncLLMEngine:
    """Serves many callers from one engine thread.

    `generate()` is an async iterator of outputs; leaving it early (a client disconnects, the task
    is cancelled) aborts the request, and the engine thread releases its blocks before its next step.

    Give it a function that builds the engine, not a built engine, and the model loads on the
    engine thread (`kvstrata serve` does). Why: OpenMP gives each thread that runs a parallel
    region its own team of workers, and once the teams hold more threads than the machine has
    CPUs, libgomp stops spin-waiting between regions: every parallel op then pays a futex wake-up.
    Loading runs parallel regions; loaded on the main thread and stepped here, the served
    shared-prefix workload's TPOT p50 was 26.6 ms, loaded here 19.8 ms (bf16, 2 threads, 2 cores).
    The price of spinning: the engine wants its cores to itself (docs/design/model.md, "Threads").

    `kv_events_kept`: publish the caches' index changes for routers (`kv_events`, a KVEventLog keeping
    the last `kv_events_kept` events); 0: publish none.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], kv_events_kept: int = 0):
        self._build = None if isinstance(engine, LLMEngine) else engine
        self._engine: LLMEngine | None = engine if self._build is None else None    # else built by start()
        self._kv_events_kept = kv_events_kept
        self._recorder: KVEventRecorder | None = None
        # Published by the engine thread (set once at build, or swapped whole once per step):
        self.info: EngineInfo | None = None
        self.prompts: PromptEncoder | None = None       # a tokenizer of the callers' own
        self.snapshot: EngineSnapshot = EngineSnapshot.empty()
        self.kv_events: KVEventLog | None = None
        self.adapters: Mapping[str, str] = {}           # the LoRA adapters served: name -> folder
        self.adapter_roots: Mapping[str, BlockHash] = {}   # and the root of their requests' block hashes
        self.adapter_reader: AdapterReader | None = None   # reads an adapter on any thread (read_adapter)
        self._adapter_reads = asyncio.Lock()                # one at a time: each holds a whole adapter in memory
        self._in_flight = 0                              # generate() calls not yet ended, counted by the callers
        self._in_flight_lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._unfinished_samples: dict[str, int] = {}      # per stream: samples still running
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._heap = HeapTrimmer()                      # freed memory back to the OS, once a minute
        self.error: BaseException | None = None

    def start(self) -> AsyncLLMEngine:
        """Start the engine thread; with a builder, return once it has built the engine (or raise what
        building raised)."""
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(built,), name="kvstrata-engine", daemon=True)
        self._thread.start()
        built.wait()
        if self.info is None:
            raise self.error
        return self

    @property
    def num_unfinished(self) -> int:
        """Requests in flight (queued, running, or streaming their last outputs)."""
        return self._in_flight

    def _count(self, delta: int) -> None:
        with self._in_flight_lock:
            self._in_flight += delta

    async def generate(self, prompt: Prompt | Tokenized, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, prediction: str | None = None, hand_off: bool = False,
                       lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as steps produce them (a family's samples interleaved,
        told apart by `index`), until every sample finished. ValueError if it cannot run. `prediction`,
        `hand_off`, `lora`: see LLMEngine.add_request."""
        if self.error is not None or self._stop.is_set():
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"async-{next(self._ids)}"
        admitted: asyncio.Future = loop.create_future()
        outputs: asyncio.Queue = asyncio.Queue()
        self._count(1)
        try:
            self._send(AddRequest(prompt, params, request_id, priority, prediction, hand_off, lora, admitted, loop,
                                  outputs))
            try:
                await admitted
            except asyncio.CancelledError:
                self.abort(request_id)     # queued after the add, so it cannot be overtaken
                raise
            unfinished = (params or SamplingParams()).num_samples
            finished = False
            try:
                while not finished:
                    out = await outputs.get()
                    if isinstance(out, BaseException):
                        raise out
                    unfinished -= out.finished
                    finished = not unfinished
                    yield out
            finally:
                if not finished:
                    self.abort(request_id)
        finally:
            self._count(-1)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (installing an adapter read elsewhere, say); its
        result, or what it raised."""
        if self.error is not None or self._stop.is_set():
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(Call(fn, done, loop))
        return await done

    async def read_adapter(self, name: str, folder: str) -> LoRAWeights:
        """The adapter a client named, read and checked in a thread of its own (beneath --lora-root), while
        the engine goes on stepping; AdapterError if it cannot be served. `call` then installs it."""
        async with self._adapter_reads:
            return await asyncio.wrap_future(self.adapter_reader.start(name, folder, trusted=False))

    def _send(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.set()

    def shutdown(self, timeout: float = 0.0) -> None:
        """Let running requests finish for up to `timeout` seconds, abort the rest, stop the thread."""
        assert self._thread is not None, "shutdown() of an engine never started"
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self._send(AbortAll())
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._engine.close()          # the thread has ended: this thread owns the engine now
        self.snapshot = self._engine.snapshot()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self, built: threading.Event) -> None:
        try:
            self._build_on_this_thread()
        except BaseException as exc:           # raised again by start(), on the caller's thread
            self.error = exc
            return
        finally:
            built.set()
        engine = self._engine
        try:
            while True:
                changed = self._drain_commands()
                if self._stop.is_set():
                    return
                self._heap.tick()
                if engine.has_work:
                    for out in engine.step():
                        self._deliver(out)
                elif engine.tiers.persist(PERSIST_BATCH) or engine.map_kv_pages(MAP_CHUNK_BYTES):
                    pass                    # idle: a few blocks to the store or KV pages mapped, then look again
                elif not changed:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._publish()
        except BaseException as exc:   # the engine is unusable (EngineDeadError): fail every caller, do not hang them
            logger.critical("engine stopped; failing %d requests", len(self._streams), exc_info=exc)
            self.error = exc
            for loop, stream in self._streams.values():
                _post(loop, stream.put_nowait, RuntimeError(f"engine failed: {exc!r}"))
            self._streams.clear()
            self._unfinished_samples.clear()

    def _build_on_this_thread(self) -> None:
        """Build the engine (when given a builder) and what it publishes, before serving anyone."""
        if self._engine is None:
            self._engine = self._build()
        engine = self._engine
        if self._kv_events_kept:
            self._recorder = KVEventRecorder([("device", engine.tiers.device), ("host", engine.tiers.host)])
            self.kv_events = KVEventLog(engine.config.cache.block_size, engine.hasher.root, self._recorder.held,
                                        self._kv_events_kept)
        self.prompts = engine.prompts.copy()
        self.adapter_reader = engine.adapters.reader
        self._publish_adapters()
        self._publish()
        self.info = engine.info          # last: start() takes it as the sign that the engine is built

    def _publish_adapters(self) -> None:
        """The LoRA adapters served, for the HTTP handlers, and their hash roots, for routers."""
        engine = self._engine
        roots = {name: engine.adapters.hasher_for(r.ref).root for name, r in engine.adapters.registered.items()}
        self.adapters, self.adapter_roots = engine.adapters.served(), MappingProxyType(roots)
        if self.kv_events is not None:
            self.kv_events.adapter_roots = {name: root.hex() for name, root in roots.items()}

    def _publish(self) -> None:
        """Swap in what other threads may read: a new snapshot, and this step's KV events."""
        snapshot = self._engine.snapshot()
        self.snapshot = snapshot
        if self._recorder is not None:
            self.kv_events.publish(self._recorder.take(),
                                   EngineLoad(snapshot.num_requests, snapshot.queued_prompt_tokens))

    def _drain_commands(self) -> bool:
        """Take every queued command; whether there was any."""
        took = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return took
            took = True
            match command:
                case AddRequest():
                    self._add(command)
                case Abort(request_id):
                    self._abort(request_id)
                case Call():
                    self._call(command)
                case AbortAll():
                    for request_id in list(self._streams):
                        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        for out in self._engine.abort(request_id):
            self._deliver(out)

    def _call(self, call: Call) -> None:
        try:
            result = call.fn(self._engine)
        except Exception as exc:      # the caller's error to answer; the engine goes on
            _post(call.loop, _settle, call.done, exc)
            return
        finally:
            self._publish_adapters()
        _post(call.loop, _resolve, call.done, result)

    def _add(self, add: AddRequest) -> None:
        try:
            self._engine.add_request(add.prompt, add.params, add.request_id, add.priority, prediction=add.prediction,
                                     hand_off=add.hand_off, lora=add.lora)
        except Exception as exc:      # a bad request: its caller gets the error, the engine goes on
            _post(add.loop, _settle, add.admitted, exc)
            return
        self._streams[add.request_id] = (add.loop, add.outputs)
        self._unfinished_samples[add.request_id] = (add.params or SamplingParams()).num_samples
        _post(add.loop, _settle, add.admitted, None)

    def _deliver(self, out: RequestOutput) -> None:
        target = self._streams.get(out.request_id)
        if target is None:
            return
        if out.finished:
            self._unfinished_samples[out.request_id] -= 1
            if not self._unfinished_samples[out.request_id]:
                del self._streams[out.request_id], self._unfinished_samples[out.request_id]
        _post(target[0], target[1].put_nowait, out)


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run `callback` on the caller's loop; a caller whose loop has closed is gone, so drop it."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        logger.debug("dropping an output for a closed event loop")


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _resolve(future: asyncio.Future, result: object) -> None:
    if not future.done():
        future.set_result(result)
