"""`--compile`: torch.compile the decoder's work before and after attention.

Why. A decode step of a few sequences is mostly the dispatch of small torch ops (norms, RoPE,
residual adds, SiLU * up, and for int8 the per-token quantization and rescaling around each matmul),
each a parallel region the threads must meet at. Inductor fuses the element-wise work into a few C++
loops (a decode step: ~1,600-1,900 dispatched ops -> ~400); the matmuls stay library calls (oneDNN,
or `_int_mm` for int8). Where it loses: float models, whose oneDNN-packed weights dynamo cannot
trace, so they keep plain ones and run slower than uncompiled (docs/design/model.md).

What is compiled: `DecoderLayer.attention_inputs` and `DecoderLayer.after_attention`, each once for
all layers: the layer is an argument, so dynamo guards on its type and tensor shapes, not on which
layer it is. Paged attention and the KV write stay eager (a plan built per step, data-dependent
shapes). `dynamic=True` keeps the token count symbolic: graphs are made per range of it that the
code branches on (one token; several), a bounded set that `warm_up` compiles at load, so no request
waits for a compile. Inductor keeps what it compiled on disk (its cache dir, /tmp/torchinductor_$USER
unless TORCHINDUCTOR_CACHE_DIR says otherwise), so a second start mostly reads it back.
"""

from __future__ import annotations

import logging
import time
from functools import cache

import torch

from kvstrata.model.network.layer import DecoderLayer

logger = logging.getLogger(__name__)

# One prefill of each size reaches every branch of the layer code: 1 token (dynamo specializes
# on it), then several; the larger sizes warm oneDNN's kernels for those row counts too.
WARM_UP_TOKENS = (1, 2, 5, 16, 128)


@cache
def compiled_steps() -> tuple:
    """The layer steps before and after attention, compiled (lazily: the first calls compile them)."""
    return (torch.compile(DecoderLayer.attention_inputs, dynamic=True),
            torch.compile(DecoderLayer.after_attention, dynamic=True))


def warm_up(model) -> float:
    """Compile a compiled model's steps now, for every token count `WARM_UP_TOKENS` reaches; the seconds it took."""
    start = time.perf_counter()
    for n in WARM_UP_TOKENS:
        model.prefill_alone(list(range(1, n + 1)))
    seconds = time.perf_counter() - start
    logger.info("compiled the decoder layers for %s tokens per step in %.1fs", "/".join(map(str, WARM_UP_TOKENS)),
                seconds)
    return seconds
