"""The engine's LoRA adapters: which names it serves, which are in memory, and who waits for one.

    registered  name -> folder and digest (checked once when registered: a bad adapter is refused then)
    resident    loaded, least recently used first: the one owner of their weights, which the engine
                hands the runner, to read, for each step
    reading     adapters being read again from disk, each in a thread of its own; with `resident`,
                at most `max_loras` (a read holds its slot)
    holders     the unfinished requests (samples) that took a slot, by adapter: one in use is never dropped
    parked      requests whose adapter is not resident (it is being read, or every slot is in use): they
                wait here, holding nothing, and enter the scheduler once it is (`admit_parked`, at the
                start of each step)

The engine thread never reads an adapter's files. A load at run time is read by the caller's thread
(`AdapterReader.start`, then `install` between steps: dict updates); a dropped adapter asked for again
is read by `AdapterReader.start` while its requests wait parked, and the step that finds the read done
makes it resident. Why a thread of its own each time, not a pool: a thread that runs torch's ops gets
an OpenMP team, and a team left alive beside the engine's makes libgomp stop spinning (AsyncLLMEngine).

An adapter's digest is fixed when it is registered. When a dropped adapter is read again from disk,
the files must still have that digest (and lie beneath --lora-root, checked again: a link swapped in
since cannot lead out); if they changed, its waiting requests end with an error naming the fix (load
it again), new ones are refused, and blocks keyed by the old content are never given to new weights.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter, OrderedDict, deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from types import MappingProxyType

import torch

from kvstrata.core.config import LoRAConfig
from kvstrata.core.errors import RequestRejected
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import AdapterRef, Request
from kvstrata.model.adapters.lora import AdapterError, LoRAWeights, load_adapter
from kvstrata.model.arch import ModelArch
from kvstrata.model.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterReader:
    """What reading an adapter takes, and nothing the engine thread owns: any thread may call it."""

    arch: ModelArch
    dtype: torch.dtype
    device: torch.device
    max_rank: int
    roots: tuple[str, ...]      # --lora-root: where an untrusted folder must lie (none: anywhere)

    def read(self, name: str, folder: str, trusted: bool) -> LoRAWeights:
        """The adapter in `folder`, read and checked on this thread; AdapterError if it cannot be served.
        `trusted`: the operator's own (--lora-modules, the Python API), not held to `roots`."""
        return load_adapter(name, folder, self.arch, self.dtype, self.device, self.max_rank,
                            () if trusted else self.roots)

    def start(self, name: str, folder: str, trusted: bool) -> Future[LoRAWeights]:
        """`read` in a thread of its own that ends with it (why not a pool: the module's docstring)."""
        future: Future[LoRAWeights] = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.read(name, folder, trusted))
                except BaseException as exc:        # handed to whoever waits on the future
                    future.set_exception(exc)
        threading.Thread(target=run, name=f"kvstrata-lora-{name[:32]}", daemon=True).start()
        return future


@dataclass(frozen=True)
class Registered:
    """An adapter this engine serves by name."""

    ref: AdapterRef
    folder: str
    trusted: bool               # the operator's own (AdapterReader.read)
    changed: bool = False       # its files changed on disk since: refused until loaded again


class Adapters:
    def __init__(self, config: LoRAConfig, loaded: LoadedModel, base_hasher: BlockHasher):
        self.config = config
        self.loaded = loaded
        self.base_hasher = base_hasher
        self.reader = AdapterReader(loaded.arch, loaded.dtype, loaded.device, config.max_lora_rank,
                                    config.lora_root)
        self.registered: dict[str, Registered] = {}
        self.resident: OrderedDict[str, LoRAWeights] = OrderedDict()   # digest -> weights, LRU first
        self.reading: dict[str, Future[LoRAWeights]] = {}   # digest -> its read from disk, holding a slot
        self.holders: dict[str, str] = {}      # request id -> digest of the adapter whose slot it holds
        self.users: Counter[str] = Counter()   # digest -> its holders
        self.parked: deque[Request] = deque()  # leaders (of their families) waiting for their adapter
        self.loads = 0                         # adapter reads from disk (registrations and reloads)
        for name, path in config.modules().items():
            self.register(name, path)
        if config.runtime_updating:
            logger.warning("LoRA adapters can be loaded at run time: any client of this server can make it read "
                           "adapter folders %s", f"beneath {', '.join(config.lora_root)}" if config.lora_root
                           else "anywhere it can read (give --lora-root to confine them)")

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def register(self, name: str, path: str) -> AdapterRef:
        """Serve the operator's adapter at `path` as `name`, read on this thread; AdapterError (nothing
        changed) if it cannot be served (see `install`)."""
        self._check_name(name, replace=True)
        try:
            weights = self.reader.read(name, str(path), trusted=True)
        except AdapterError as exc:
            raise AdapterError(f"cannot serve the adapter at {path}: {exc}") from exc
        return self.install(name, str(path), weights, trusted=True)

    def install(self, name: str, folder: str, weights: LoRAWeights, trusted: bool, replace: bool = True) -> AdapterRef:
        """Serve `weights` (read from `folder`) as `name`: the cheap step, on the engine thread. AdapterError
        (nothing changed) if the engine serves no adapters, the name is the base model's, or it is taken
        and not `replace`. Loading a name again replaces its adapter: new requests take the new digest,
        those in flight finish under the old."""
        self._check_name(name, replace)
        self.loads += 1
        ref = AdapterRef(name, weights.digest)
        replaced = self.registered.get(name)
        self.registered[name] = Registered(ref, folder, trusted)
        if replaced is not None and self.users[replaced.ref.digest] == 0 \
                and replaced.ref.digest not in self._registered_digests():
            self._drop(replaced.ref.digest)     # its old weights: no request runs under them
        self._make_resident(weights)
        logger.info("LoRA adapter %r (rank %d, %.1f MiB, digest %s) from %r", name, weights.rank,
                    weights.nbytes / 2**20, weights.digest[:12], folder[:256])
        return ref

    def _check_name(self, name: str, replace: bool) -> None:
        if not self.enabled:
            raise AdapterError("this engine serves no adapters (start it with --enable-lora)")
        if not name or name == self.loaded.name:
            raise AdapterError(f"an adapter cannot be named {name!r} (the base model's name)")
        if name in self.registered and not replace:
            raise AdapterError(f"the LoRA adapter {name!r} is already loaded; send load_inplace: true to replace "
                               "its weights")

    def unregister(self, name: str) -> None:
        """Stop serving `name`; its requests in flight finish under it. AdapterError if it is unknown."""
        if name not in self.registered:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        digest = self.registered.pop(name).ref.digest
        if self.users[digest] == 0 and digest not in self._registered_digests():
            self._drop(digest)

    def served(self) -> MappingProxyType:
        """name -> folder of every adapter served, a copy other threads may read."""
        return MappingProxyType({name: str(r.folder) for name, r in self.registered.items()})

    def resolve(self, name: str | None) -> AdapterRef | None:
        """The adapter a request names (None or the base model's name: none); RequestRejected naming
        what is served."""
        if name is None or name == self.loaded.name:
            return None
        if not self.enabled:
            raise RequestRejected(f"this server serves no LoRA adapters (asked for {name!r}); start it with "
                                  "--enable-lora", "model")
        try:
            return self.ref(name)
        except AdapterError as exc:
            raise RequestRejected(str(exc), "model") from exc

    def hasher_for(self, ref: AdapterRef | None) -> BlockHasher:
        """The block hasher of a request under `ref`: its root salted by the adapter's digest."""
        if ref is None:
            return self.base_hasher
        return self.base_hasher.for_adapter(ref.digest)

    def ref(self, name: str) -> AdapterRef:
        if name not in self.registered:
            raise AdapterError(f"no adapter named {name!r}; loaded: {', '.join(sorted(self.registered)) or 'none'}")
        if self.registered[name].changed:
            raise AdapterError(_changed(name))
        return self.registered[name].ref

    # ---- requests -------------------------------------------------------------------------------
    def admit(self, leader: Request) -> bool:
        """Take a slot for a new request's adapter (True), or park it (False) while its adapter is read
        again or every slot is in use. A base request always enters."""
        if leader.adapter is None:
            return True
        if self.parked or not self._take_slot(leader.adapter):
            self.parked.append(leader)
            return False
        self._hold(leader)
        return True

    def _hold(self, leader: Request) -> None:
        for sample in leader.samples:
            self.holders[sample.request_id] = leader.adapter.digest
            self.users[leader.adapter.digest] += 1

    def admit_parked(self) -> tuple[list[Request], list[tuple[Request, AdapterError]]]:
        """The parked requests whose adapter is now resident (in arrival order), and those whose adapter
        could not be read again (each with its error)."""
        failed_reads = self._settle_reads()
        admitted, failed = [], []
        while self.parked:
            leader = self.parked[0]
            try:
                if leader.adapter.digest in failed_reads:
                    raise failed_reads[leader.adapter.digest]
                if not self._take_slot(leader.adapter):
                    break
            except AdapterError as exc:
                self.parked.popleft()
                failed.append((leader, exc))
                continue
            self.parked.popleft()
            self._hold(leader)
            admitted.append(leader)
        return admitted, failed

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a read from disk may have finished (the engine calls this when it has nothing else)."""
        if self.reading:
            wait(self.reading.values(), timeout=timeout, return_when=FIRST_COMPLETED)

    def release(self, request: Request) -> None:
        """A finished request (one sample) gives back its adapter's slot, if it held one (a request that
        ended while parked never did)."""
        digest = self.holders.pop(request.request_id, None)
        if digest is None:
            return
        self.users[digest] -= 1
        if self.users[digest] == 0:
            del self.users[digest]
            if digest not in self._registered_digests():
                self._drop(digest)              # replaced or unloaded while this request ran

    def unpark(self, request_id: str) -> Request | None:
        """Take the parked request with this id (a family's) out of the queue, if it is there."""
        for leader in self.parked:
            if request_id in (leader.request_id, leader.family.family_id if leader.family else None):
                self.parked.remove(leader)
                return leader
        return None

    def audit(self) -> None:
        assert len(self.resident) + len(self.reading) <= self.config.max_loras, "more adapter slots than max_loras"
        assert not set(self.reading) & set(self.resident), "an adapter read again while resident"
        assert set(self.users) <= set(self.resident), "a request runs under an adapter that is not resident"
        assert sum(self.users.values()) == len(self.holders), "holders and users disagree"

    # ---- slots ----------------------------------------------------------------------------------
    def _take_slot(self, ref: AdapterRef) -> bool:
        """True if `ref`'s weights are resident; else False, having started reading them again into a
        free slot if there is one. AdapterError if the adapter is no longer served as `ref`."""
        if ref.digest in self.resident:
            self.resident.move_to_end(ref.digest)
            return True
        registered = next((r for r in self.registered.values() if r.ref == ref), None)
        if registered is None:
            raise AdapterError(f"the adapter {ref.name!r} was unloaded before this request could run")
        if registered.changed:
            raise AdapterError(_changed(ref.name))
        if ref.digest not in self.reading and self._free_slot():
            self.loads += 1
            self.reading[ref.digest] = self.reader.start(ref.name, registered.folder, registered.trusted)
        return False

    def _settle_reads(self) -> dict[str, AdapterError]:
        """Make the adapters read in full resident (their slots were held for them); the digests whose
        read failed, with why. Files that changed on disk mark their name `changed`."""
        failed = {}
        for digest, future in [(d, f) for d, f in self.reading.items() if f.done()]:
            del self.reading[digest]
            try:
                weights = future.result()
            except AdapterError as exc:
                failed[digest] = exc
                continue
            except Exception as exc:        # a bug, not the files: its requests end, the engine goes on
                logger.error("reading LoRA adapter %s again failed", digest[:12], exc_info=exc)
                failed[digest] = AdapterError(f"reading it again failed ({type(exc).__name__})")
                continue
            if weights.digest != digest:
                failed[digest] = AdapterError(_changed(weights.name))
                name = next((n for n, r in self.registered.items() if r.ref.digest == digest), None)
                if name is not None:
                    self.registered[name] = dataclasses.replace(self.registered[name], changed=True)
            elif digest in self._registered_digests():
                self.resident[digest] = weights
        for digest, exc in failed.items():
            logger.warning("LoRA adapter %s could not be read again: %s", digest[:12], exc)
        return failed

    def _make_resident(self, weights: LoRAWeights) -> None:
        if weights.digest in self.resident:
            self.resident.move_to_end(weights.digest)
        elif self.reading.pop(weights.digest, None) is not None or self._free_slot():
            self.resident[weights.digest] = weights     # (in the slot of its read again, if one was running)
        # else every slot is busy: it stays registered and is read again when one frees

    def _free_slot(self) -> bool:
        """Whether a slot is free, dropping the least recently used idle adapter if need be."""
        while len(self.resident) + len(self.reading) >= self.config.max_loras:
            idle = self._idle()
            if idle is None:
                return False
            self._drop(idle)
        return True

    def _idle(self) -> str | None:
        """The least recently used resident adapter no unfinished request runs under."""
        return next((digest for digest in self.resident if self.users[digest] == 0), None)

    def _drop(self, digest: str) -> None:
        self.resident.pop(digest, None)

    def _registered_digests(self) -> set[str]:
        return {r.ref.digest for r in self.registered.values()}


def _changed(name: str) -> str:
    return (f"the files of adapter {name!r} changed on disk since it was loaded; load it again "
            "(POST /v1/load_lora_adapter) to serve the new weights")
