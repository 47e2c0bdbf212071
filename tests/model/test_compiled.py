"""`--compile`: the compiled decoder layers compute what the eager ones do, for every branch the
warm-up compiled (one token, a few, many; prefill chunks and decodes in one batch), and compile
nothing more afterwards."""

from __future__ import annotations

import random

import pytest
import torch

from kvstrata.core.config import ModelConfig
from kvstrata.model.loader import load_model
from kvstrata.model.network.compiled import WARM_UP_TOKENS
from tests.model.model_helpers import Seq, new_cache, run_step, save_tiny_hf_model
from tests.model.test_model import CONFIGS


def steps_logits(loaded, seed: int) -> list[torch.Tensor]:
    """Prefill three prompts in pieces, then decode them together: the logits of every step."""
    rng = random.Random(seed)
    seqs = [Seq([rng.randrange(3, 250) for _ in range(n)], list(range(1 + 10 * i, 11 + 10 * i)))
            for i, n in enumerate((40, 7, 19))]
    kv = new_cache(loaded, 40, 8)
    out = [run_step(loaded.model, kv, [(seqs[0], 23), (seqs[1], 7)])]
    seqs[1].tokens.append(int(seqs[1].logits[-1].argmax()))
    out.append(run_step(loaded.model, kv, [(seqs[1], 1), (seqs[0], 17), (seqs[2], 19)]))
    for _ in range(4):
        for seq in seqs:
            seq.tokens.append(int(seq.logits[-1].argmax()))
        out.append(run_step(loaded.model, kv, [(s, 1) for s in seqs]))
    return out


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_compiled_layers_match_eager(tmp_path, monkeypatch, quantization):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))
    save_tiny_hf_model(tmp_path / "model", CONFIGS["llama"]())
    config = dict(model=str(tmp_path / "model"), dtype="float32", device="cpu", quantization=quantization)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = load_model(ModelConfig(**config, compile=True))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    if compiled.int8 is not None:     # eager's own choice is timed: on a busy machine another kernel, other roundings
        monkeypatch.setenv("KVSTRATA_INT8_KERNEL", compiled.int8.kernel)
    eager = load_model(ModelConfig(**config))
    assert eager.int8 is None or eager.int8.kernel == compiled.int8.kernel
    # A bounded set, made at load; an int8 kernel dynamo cannot trace (FBGEMM's, where the CPU has
    # no VNNI for `_int_mm`) splits the two layer steps around their four projections.
    pieces = 2 if compiled.int8 is None or compiled.int8.kernel == "int_mm" else 6
    assert 2 <= graphs <= pieces * len(WARM_UP_TOKENS)
    for ours, ref in zip(steps_logits(compiled, 1), steps_logits(eager, 1)):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs   # nothing compiled while serving
