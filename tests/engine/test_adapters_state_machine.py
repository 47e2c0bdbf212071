"""Property test: LoRA adapters never share a block, on the real model and every tier.

Base + 3 adapters on shared prompts, two adapter slots (so requests park and adapters are read
again), reloads under an old name with other weights (and back), aborts, preemption, a small device
tier spilling to host and a disk store. Every step is audited (blocks and adapter slots).

The oracle: a request may be served from cache at most the prompt blocks that some earlier request
under the *same digest* could have computed (its prompt and, once finished, its output). A cached
count above that bound is a cross-adapter hit. And greedy fp32 outputs of one (digest, prompt) are
always the same tokens, cached or not. Each run counts what it reached: requests that had another
digest's blocks on offer (cross-adapter chances, none may hit), same-digest revisits that hit,
parks, reloads, preemptions, aborts, host and store hits; a zero fails the test.
"""

import os
import random
from collections import Counter
from concurrent.futures import wait

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from kvstrata.core.config import EngineConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from tests.reached import assert_reached

EXAMPLES = int(os.environ.get("KVSTRATA_ADAPTERS_MACHINE_EXAMPLES", "15"))
STEPS = 30
BLOCK = 16
SHARED = "A long shared preamble about tiers, blocks and adapters that many requests begin with. " * 2
PROMPTS = [SHARED + tail for tail in ("Question one:", "Another question, two:")] + \
          ["A different opening entirely, with no shared words at all, for the third prompt. " * 2]
NAMES = (None, "alpha", "beta", "gamma")
REACHED = ("cross_adapter_chance", "same_adapter_hit", "parked", "reload", "preemption", "abort", "host_hit",
           "store_hit")


def settled_step(engine: LLMEngine) -> list:
    """A step once every adapter being read again has been read: when a read ends is the clock's to say,
    and hypothesis must see the same run each time it replays one (other tests leave reads running)."""
    wait(list(engine.adapters.reading.values()))
    return engine.step()


def adapters_machine(smollm2, adapters: dict, store_root, reached: Counter) -> type[RuleBasedStateMachine]:
    class AdaptersMachine(RuleBasedStateMachine):
        @initialize(seed=st.integers(0, 2**16))
        def setup(self, seed):
            self.rng = random.Random(seed)
            store = store_root / f"store-{seed}-{reached['runs']}"
            reached["runs"] += 1
            modules = tuple(f"{name}={adapters[name]}" for name in NAMES[1:])
            self.engine = LLMEngine(EngineConfig.from_options(
                audit_every_step=True, block_size=BLOCK, num_device_blocks=10, num_host_blocks=4,
                kv_cache_memory="64MiB", store="disk", store_path=str(store), max_num_seqs=4,
                lora_modules=modules, max_loras=2), loaded=smollm2)
            self.swapped = False                 # alpha's name serves delta's weights
            self.computed: dict[str, set[tuple[int, ...]]] = {}    # digest -> block prefixes computed under it
            self.outputs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
            self.live: dict[str, tuple] = {}     # request id -> (request, digest, prompt, cached tokens allowed)
            self.aborted: set[str] = set()

        def _prefixes(self, tokens) -> list[tuple[int, ...]]:
            return [tuple(tokens[:n]) for n in range(BLOCK, len(tokens) + 1, BLOCK)]

        @rule(name=st.sampled_from(NAMES), prompt=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, 8),
              reload=st.integers(0, 7))
        def submit(self, name, prompt, max_tokens, reload):
            if reload == 0:
                self._reload()
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            request = self.engine.add_request(PROMPTS[prompt], params, lora=name)
            digest = request.adapter.digest if request.adapter else ""
            tokens = tuple(request.prompt_token_ids)
            if any(p in done for d, done in self.computed.items() if d != digest for p in self._prefixes(tokens)):
                reached["cross_adapter_chance"] += 1
            reached["parked"] += request in self.engine.adapters.parked
            bound = sum(p in self.computed.get(digest, ()) for p in self._prefixes(tokens)) * BLOCK
            self.computed.setdefault(digest, set()).update(self._prefixes(tokens))
            self.live[request.request_id] = (request, digest, tokens, bound)

        @precondition(lambda self: self.live)
        @rule(steps=st.integers(1, 6))
        def step(self, steps):
            for _ in range(steps):
                self._take(settled_step(self.engine))

        @precondition(lambda self: self.live)
        @rule()
        def abort(self):
            request_id = self.rng.choice(sorted(self.live))
            self.aborted.add(request_id)
            reached["abort"] += 1
            self._take(self.engine.abort(request_id))

        @precondition(lambda self: self.live)
        @rule()
        def preempt(self):
            reached["preemption"] += self.engine.scheduler.preempt(self.rng.choice(sorted(self.live)))

        def _reload(self):
            """Serve other weights under alpha's name, or its own again (their digest: their old blocks)."""
            self.swapped = not self.swapped
            self.engine.adapters.register("alpha", adapters["delta" if self.swapped else "alpha"])
            reached["reload"] += 1

        def _take(self, outputs):
            for out in outputs:
                if not out.finished or out.request_id not in self.live:
                    continue
                request, digest, tokens, bound = self.live.pop(out.request_id)
                assert request.num_cached_tokens <= bound, \
                    f"{out.request_id} was served {request.num_cached_tokens} cached tokens; only " \
                    f"{bound} were ever computed under its adapter"
                if out.finish_reason in ("length", "stop") and out.request_id not in self.aborted:
                    reached["same_adapter_hit"] += request.num_cached_tokens > 0
                    produced = request.output_token_ids
                    known = self.outputs.setdefault((digest, tokens), produced)
                    n = min(len(known), len(produced))
                    assert produced[:n] == known[:n], f"{out.request_id}: greedy tokens differ for one adapter"
                    if len(produced) > len(known):
                        self.outputs[(digest, tokens)] = produced
                    self.computed[digest].update(self._prefixes(request.token_ids))

        def teardown(self):
            engine = getattr(self, "engine", None)
            if engine is None:
                return
            for request_id in list(self.live):
                self._take(engine.abort(request_id))
            while engine.has_work:
                settled_step(engine)
            counts = engine.tiers.audit()
            assert all(c.used == 0 and c.in_flight == 0 for c in counts.values()), counts
            assert not engine.adapters.holders and not engine.adapters.parked
            engine.adapters.audit()
            stats = engine.tiers.stats
            reached["host_hit"] += stats.hit_tokens["host"] > 0
            reached["store_hit"] += stats.hit_tokens["store"] > 0
            reached["preemption"] += engine.scheduler.num_preemptions > 0
            engine.close()

    return AdaptersMachine


def run_machine(smollm2, lora_adapters, tmp_path, examples: int) -> Counter:
    reached: Counter = Counter()
    run_state_machine_as_test(adapters_machine(smollm2, lora_adapters, tmp_path, reached), settings=settings(
        max_examples=examples, stateful_step_count=STEPS, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    assert_reached(reached, REACHED, "adapter machine")
    return reached


def test_adapters_never_share_blocks_under_reloads_aborts_preemption_and_tiers(smollm2, lora_adapters, tmp_path):
    run_machine(smollm2, lora_adapters, tmp_path, EXAMPLES)


@pytest.mark.slow
def test_adapters_machine_long_run(smollm2, lora_adapters, tmp_path):
    """`make test-slow`: 100 runs of 30 steps (~1 min)."""
    run_machine(smollm2, lora_adapters, tmp_path, 100)
