"""The engine's LoRA adapters: which names it serves, which are in memory, and who waits for one.

    registered  name -> folder and digest (checked once when registered: a bad adapter is refused then)
    resident    at most `max_loras` loaded, least recently used first: the one owner of their weights, which
                the engine hands the runner, to read, for each step
    holders     the unfinished requests (samples) that took a slot, by adapter: one in use is never dropped
    parked      requests whose adapter found every slot in use: they wait here, holding nothing, and
                enter the scheduler when a slot frees (`admit_parked`, at the start of each step)

An adapter's digest is fixed when it is registered. When a dropped adapter is read again from disk,
the files must still have that digest; if they changed, the request ends with an error naming the
fix (load it again), so blocks keyed by the old content are never given to new weights.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from kvstrata.core.config import LoRAConfig
from kvstrata.core.errors import RequestRejected
from kvstrata.core.hashing import BlockHasher
from kvstrata.core.request import AdapterRef, Request
from kvstrata.model.adapters.lora import AdapterError, LoRAWeights, load_adapter
from kvstrata.model.loader import LoadedModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registered:
    """An adapter this engine serves by name."""

    ref: AdapterRef
    folder: Path


class Adapters:
    def __init__(self, config: LoRAConfig, loaded: LoadedModel, base_hasher: BlockHasher):
        self.config = config
        self.loaded = loaded
        self.base_hasher = base_hasher
        self.registered: dict[str, Registered] = {}
        self.resident: OrderedDict[str, LoRAWeights] = OrderedDict()   # digest -> weights, LRU first
        self.holders: dict[str, str] = {}      # request id -> digest of the adapter whose slot it holds
        self.users: Counter[str] = Counter()   # digest -> its holders
        self.parked: deque[Request] = deque()  # leaders (of their families) waiting for a slot
        self.loads = 0                         # adapter reads from disk (registrations and reloads)
        for name, path in config.modules().items():
            self.register(name, path)

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def register(self, name: str, path: str | Path) -> AdapterRef:
        """Serve the adapter at `path` as `name`; AdapterError (nothing changed) if it cannot be served or
        the name is the base model's. Loading a name again replaces its adapter (the HTTP endpoint asks
        for `load_inplace` first): new requests take the new digest, those in flight finish under the old."""
        if not self.enabled:
            raise AdapterError("this engine serves no adapters (start it with --enable-lora)")
        if not name or name == self.loaded.name:
            raise AdapterError(f"an adapter cannot be named {name!r} (the base model's name)")
        weights = self._read(name, Path(path))
        ref = AdapterRef(name, weights.digest)
        replaced = self.registered.get(name)
        self.registered[name] = Registered(ref, Path(path))
        if replaced is not None and self.users[replaced.ref.digest] == 0 \
                and replaced.ref.digest not in self._registered_digests():
            self._drop(replaced.ref.digest)     # its old weights: no request runs under them
        self._make_resident(weights)
        logger.info("LoRA adapter %r (rank %d, %.1f MiB, digest %s) from %s", name, weights.rank,
                    weights.nbytes / 2**20, weights.digest[:12], path)
        return ref

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
        return self.registered[name].ref

    # ---- requests -------------------------------------------------------------------------------
    def admit(self, leader: Request) -> bool:
        """Take a slot for a new request's adapter (True), or park it (False). A base request always
        enters. AdapterError if its adapter must be read again and cannot be (the request holds nothing)."""
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
        """The parked requests that now have a slot (in arrival order), and those whose adapter could
        not be read again (each with its error)."""
        admitted, failed = [], []
        while self.parked:
            leader = self.parked[0]
            try:
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
        assert len(self.resident) <= self.config.max_loras, "more adapters resident than max_loras"
        assert set(self.users) <= set(self.resident), "a request runs under an adapter that is not resident"
        assert sum(self.users.values()) == len(self.holders), "holders and users disagree"

    # ---- slots ----------------------------------------------------------------------------------
    def _take_slot(self, ref: AdapterRef) -> bool:
        if ref.digest in self.resident:
            self.resident.move_to_end(ref.digest)
            return True
        if len(self.resident) >= self.config.max_loras and self._idle() is None:
            return False
        name = next((r.ref.name for r in self.registered.values() if r.ref == ref), None)
        if name is None:
            raise AdapterError(f"the adapter {ref.name!r} was unloaded before this request could run")
        weights = self._read(name, self.registered[name].folder)
        if weights.digest != ref.digest:
            raise AdapterError(f"the files of adapter {name!r} changed on disk since it was loaded; load it "
                               f"again (POST /v1/load_lora_adapter) to serve the new weights")
        self._make_resident(weights)
        return True

    def _make_resident(self, weights: LoRAWeights) -> None:
        if weights.digest in self.resident:
            self.resident.move_to_end(weights.digest)
            return
        while len(self.resident) >= self.config.max_loras:
            idle = self._idle()
            if idle is None:
                return          # every slot busy: it stays registered and is read again when a slot frees
            self._drop(idle)
        self.resident[weights.digest] = weights

    def _idle(self) -> str | None:
        """The least recently used resident adapter no unfinished request runs under."""
        return next((digest for digest in self.resident if self.users[digest] == 0), None)

    def _drop(self, digest: str) -> None:
        self.resident.pop(digest, None)

    def _read(self, name: str, folder: Path) -> LoRAWeights:
        self.loads += 1
        return load_adapter(name, folder, self.loaded.arch, self.loaded.dtype, self.loaded.device,
                            self.config.max_lora_rank)

    def _registered_digests(self) -> set[str]:
        return {r.ref.digest for r in self.registered.values()}

