"""LoRA adapters in the engine: cached blocks keyed by what was computed (the adapter's digest), never by
its name; adapter slots (`--max-loras`) that park a request rather than refuse it; adapter loads that
fail leaving nothing behind. Every step is audited (blocks and adapter slots)."""

import hashlib
import shutil
import threading
import time

import pytest

from kvstrata.core.config import EngineConfig
from kvstrata.core.hashing import HASH_FORMAT_VERSION, BlockHasher, adapter_root, chain_root
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = "Rivers, castles and vineyards shaped the Loire valley over many centuries of history. " * 3 + "In short:"
FILLERS = [f"Unrelated text number {i}: " + "lorem ipsum dolor sit amet " * 8 for i in range(6)]


def engine(smollm2, adapters: dict, **options):
    options = dict(dict(block_size=16, num_device_blocks=64, kv_cache_memory="64MiB",
                        lora_modules=tuple(f"{name}={path}" for name, path in adapters.items())), **options)
    return LLMEngine(EngineConfig.from_options(audit_every_step=True, **options), loaded=smollm2)


def steps_until_done(e, seconds: float = 30.0):
    """Yield until the engine has nothing unfinished (a step waits a few ms for an adapter being read)."""
    deadline = time.monotonic() + seconds
    while e.has_unfinished:
        assert time.monotonic() < deadline, "the engine did not finish"
        yield


def admitted(e, request):
    """Step until `request`'s adapter has been read again and the request holds its slot."""
    deadline = time.monotonic() + 30
    while request in e.adapters.parked:
        assert time.monotonic() < deadline, "the adapter was never read"
        e.step()
    return request


def at_rest(e):
    while e.has_work:
        e.step()
    counts = e.tiers.audit()
    assert all(c.used == 0 and c.in_flight == 0 for c in counts.values())
    assert not e.adapters.holders and not e.adapters.parked
    e.adapters.audit()


def test_the_base_models_root_is_unchanged_and_each_adapter_digest_has_its_own():
    old = hashlib.sha256(b"\0".join((HASH_FORMAT_VERSION, b"fp", b"salt"))).digest()[:16]
    assert chain_root("fp", "salt") == old                    # stores written before adapters still hit
    base = BlockHasher.create(16, "fp", "salt")
    roots = {base.root, base.for_adapter("d1").root, base.for_adapter("d2").root,
             BlockHasher.create(16, "fp", "other").for_adapter("d1").root}   # another tenant, the same adapter
    assert len(roots) == 4 and base.for_adapter("d1").root == adapter_root(base.root, "d1")


def test_a_prompt_never_hits_another_adapters_blocks_and_hits_its_own(smollm2, lora_adapters):
    e = engine(smollm2, {"alpha": lora_adapters["alpha"], "gamma": lora_adapters["gamma"]})
    base = e.generate([PROMPT], GREEDY)[0]
    alpha = e.generate([PROMPT], GREEDY, lora="alpha")[0]
    gamma = e.generate([PROMPT], GREEDY, lora="gamma")[0]
    assert alpha.num_cached_tokens == 0 and gamma.num_cached_tokens == 0       # the base's blocks are there
    again = e.generate([PROMPT], GREEDY, lora=["alpha"])[0]
    assert again.num_cached_tokens >= 48 and again.new_token_ids == alpha.new_token_ids
    assert alpha.new_token_ids != base.new_token_ids          # so a wrong hit would show in the tokens too
    at_rest(e)


def test_a_reload_under_the_same_name_never_reaches_the_old_weights_blocks(smollm2, lora_adapters):
    e = engine(smollm2, {"alpha": lora_adapters["alpha"]})
    first = e.generate([PROMPT], GREEDY, lora="alpha")[0]
    e.adapters.register("alpha", lora_adapters["delta"])            # new weights, old name
    reloaded = e.generate([PROMPT], GREEDY, lora="alpha")[0]
    assert reloaded.num_cached_tokens == 0
    fresh = engine(smollm2, {"delta": lora_adapters["delta"]}).generate([PROMPT], GREEDY, lora="delta")[0]
    assert reloaded.new_token_ids == fresh.new_token_ids != first.new_token_ids
    assert len(e.adapters.resident) == 1                            # the old weights were dropped
    e.adapters.register("alpha", lora_adapters["alpha"])            # the first weights again: their blocks hit
    assert e.generate([PROMPT], GREEDY, lora="alpha")[0].num_cached_tokens >= 48
    at_rest(e)


def test_a_request_waits_for_a_busy_adapter_slot_and_is_not_refused(smollm2, lora_adapters):
    names = ["alpha", "beta", "gamma"]
    alone = {name: engine(smollm2, {name: lora_adapters[name]}).generate([PROMPT], GREEDY, lora=name)[0].new_token_ids
             for name in names}
    e = engine(smollm2, {name: lora_adapters[name] for name in names}, max_loras=1)
    loads = e.adapters.loads
    requests = [e.add_request(PROMPT, GREEDY, lora=name) for name in names] + [e.add_request(PROMPT, GREEDY)]
    # alpha waits too: gamma, registered last, holds the one slot, so alpha is read again (off this thread)
    assert [r in e.adapters.parked for r in requests] == [True, True, True, False]
    outputs = {}
    while e.has_unfinished:
        for out in e.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert len(e.adapters.resident) + len(e.adapters.reading) == 1      # a read holds the slot
    assert [outputs[r.request_id] for r in requests[:3]] == [alone[name] for name in names]
    assert e.adapters.loads - loads == 3            # each read again from disk once (gamma, registered last, was in)
    at_rest(e)


def test_aborting_a_parked_request_ends_it_holding_nothing(smollm2, lora_adapters):
    e = engine(smollm2, {n: lora_adapters[n] for n in ("alpha", "gamma")}, max_loras=1)
    running = admitted(e, e.add_request(PROMPT, GREEDY, lora="alpha"))
    parked = e.add_request(PROMPT, SamplingParams(n=2, max_tokens=4), request_id="waiting", lora="gamma")
    assert parked in e.adapters.parked
    finals = e.abort("waiting")
    assert sorted((o.index, o.finish_reason) for o in finals) == [(0, "abort"), (1, "abort")]
    assert not e.adapters.parked and running.request_id not in {o.request_id for o in finals}
    at_rest(e)


def test_an_adapter_whose_files_changed_while_dropped_ends_its_request_with_an_error(smollm2, lora_adapters, tmp_path):
    folder = tmp_path / "changing"
    shutil.copytree(lora_adapters["gamma"], folder)
    e = engine(smollm2, {"changing": folder, "alpha": lora_adapters["alpha"]}, max_loras=1)
    admitted(e, e.add_request(PROMPT, GREEDY, lora="alpha"))          # holds the one slot
    waiting = e.add_request(PROMPT, GREEDY, lora="changing")
    assert waiting in e.adapters.parked
    shutil.rmtree(folder)
    shutil.copytree(lora_adapters["beta"], folder)                   # other weights under the same path
    outputs = [out for _ in steps_until_done(e) for out in e.step()]
    ended = [out for out in outputs if out.request_id == waiting.request_id]
    assert [(out.finish_reason, out.new_token_ids) for out in ended] == [("error", [])]
    at_rest(e)
    with pytest.raises(ValueError, match="changed on disk"):          # a new request is refused at once
        e.add_request(PROMPT, GREEDY, lora="changing")
    at_rest(e)


def test_unknown_adapters_and_engines_without_lora_refuse_with_the_reason(smollm2, lora_adapters):
    e = engine(smollm2, {"alpha": lora_adapters["alpha"]})
    with pytest.raises(ValueError, match="no adapter named 'nope'; loaded: alpha"):
        e.add_request(PROMPT, GREEDY, lora="nope")
    plain = LLMEngine(EngineConfig.from_options(kv_cache_memory="64MiB"), loaded=smollm2)
    with pytest.raises(ValueError, match="start it with --enable-lora"):
        plain.add_request(PROMPT, GREEDY, lora="alpha")
    with pytest.raises(ValueError, match="--compile"):
        EngineConfig.from_options(enable_lora=True, compile=True)
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig.from_options(lora_modules=("just-a-path",))


def test_an_adapters_blocks_survive_a_restart_through_the_store_and_only_for_its_content(smollm2, lora_adapters,
                                                                                         tmp_path):
    first = engine(smollm2, {"alpha": lora_adapters["alpha"]}, store="disk", store_path=str(tmp_path),
                   write_policy="write_through")
    reference = first.generate([PROMPT], GREEDY, lora="alpha")[0].new_token_ids
    first.close()
    renamed = engine(smollm2, {"renamed": lora_adapters["alpha"], "alpha": lora_adapters["delta"]},
                     store="disk", store_path=str(tmp_path))
    impostor = renamed.generate([PROMPT], GREEDY, lora="alpha")[0]      # the name, other weights: no hit
    assert impostor.num_cached_tokens == 0
    out = renamed.generate([PROMPT], GREEDY, lora="renamed")[0]         # the content, another name: hits
    assert out.new_token_ids == reference and renamed.tiers.stats.hit_tokens["store"] >= 48
    renamed.close()


def test_evicted_adapter_blocks_come_back_from_host_for_that_adapter_only(smollm2, lora_adapters):
    e = engine(smollm2, {"alpha": lora_adapters["alpha"]}, num_device_blocks=24, num_host_blocks=64)
    first = e.generate([PROMPT], GREEDY, lora="alpha")[0]
    for filler in FILLERS:
        e.generate([filler], GREEDY)
    base = e.generate([PROMPT], GREEDY)[0]
    again = e.generate([PROMPT], GREEDY, lora="alpha")[0]
    assert base.num_cached_tokens == 0 and again.num_cached_tokens >= 48
    assert again.new_token_ids == first.new_token_ids and e.tiers.stats.hit_tokens["host"] >= 48
    at_rest(e)


def test_speculation_and_structured_output_run_under_an_adapter(smollm2, lora_adapters):
    """Greedy with n-gram drafts under an adapter is token for token plain decoding under it (fp32), and
    a regex-constrained answer under it obeys the regex."""
    import re

    from kvstrata.core.sampling_params import GrammarSpec
    from tests.engine.test_speculative import NGRAM, REPEATING

    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = engine(smollm2, {"alpha": lora_adapters["alpha"]}, enable_prefix_caching=False)
    spec = engine(smollm2, {"alpha": lora_adapters["alpha"]}, speculative_config=NGRAM)
    spec.step_cost.draft_break_even = lambda decodes: 0.0     # drafts verified whether or not they pay here
    expected = plain.generate([REPEATING], params, lora="alpha")[0]
    assert expected.new_token_ids != plain.generate([REPEATING], params)[0].new_token_ids
    assert spec.generate([REPEATING], params, lora="alpha")[0].new_token_ids == expected.new_token_ids
    assert 0 < spec.stats.spec_decode_num_accepted_tokens
    regex = "[a-z ]{4,24}"
    shaped = spec.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0,
                                                    structured=GrammarSpec("regex", regex)), lora="alpha")[0]
    assert shaped.finish_reason == "stop" and re.fullmatch(regex, shaped.text)
    at_rest(spec)


def test_a_dropped_adapter_is_read_again_off_the_stepping_thread(smollm2, lora_adapters, monkeypatch):
    from kvstrata.engine import adapters as engine_adapters

    readers = []
    real = engine_adapters.load_adapter
    monkeypatch.setattr(engine_adapters, "load_adapter", lambda *args: readers.append(threading.current_thread())
                        or real(*args))
    e = engine(smollm2, {n: lora_adapters[n] for n in ("alpha", "gamma")}, max_loras=1)
    assert readers == [threading.current_thread()] * 2        # --lora-modules: read where the engine is built
    request = e.add_request(PROMPT, GREEDY, lora="alpha")      # gamma holds the slot: alpha is read again
    assert request in e.adapters.parked and len(readers) == 3 and readers[2] is not threading.current_thread()
    admitted(e, request)
    outputs = [out for _ in steps_until_done(e) for out in e.step()]
    assert outputs[-1].finish_reason == "length"
    at_rest(e)


def test_a_runtime_adapter_read_again_must_still_lie_beneath_the_root(smollm2, lora_adapters, tmp_path):
    """A link swapped after the load is checked when the adapter is read again: the same bytes outside the
    root are still refused, and the request waiting for them ends with an error."""
    root = tmp_path / "root"
    shutil.copytree(lora_adapters["gamma"], root / "gamma")
    (root / "current").symlink_to(root / "gamma")
    e = engine(smollm2, {"alpha": lora_adapters["alpha"]}, max_loras=1, lora_root=(str(root),))
    folder = str(root / "current")
    e.adapters.install("swap", folder, e.adapters.reader.read("swap", folder, trusted=False), trusted=False)
    admitted(e, e.add_request(PROMPT, GREEDY, lora="alpha"))          # swap dropped: alpha holds the slot
    (root / "current").unlink()
    (root / "current").symlink_to(lora_adapters["gamma"])             # the same files, outside the root
    waiting = e.add_request(PROMPT, GREEDY, lora="swap")
    outputs = [out for _ in steps_until_done(e) for out in e.step()]
    ended = [(o.finish_reason, o.new_token_ids) for o in outputs if o.request_id == waiting.request_id]
    assert ended == [("error", [])]
    at_rest(e)
