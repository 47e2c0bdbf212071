"""Will the model, its KV cache and the host tier fit? Asked before anything is allocated.

A model too big for the machine must be refused at start with the figures and a way out, never
killed by the OOM killer halfway through a load of several minutes. Counted on the host: the
weights at their peak while loading (each weight format's `footprint`, kvstrata.model.formats), then the weights once loaded plus
the device KV (on CPU the device tier is host memory) plus the host tier, plus `HEADROOM` for
activations, the tokenizer and the interpreter. On CUDA the weights and the device KV are counted
against the GPU's free memory and the host tier against the host's.
"""

from __future__ import annotations

import logging

import torch

from kvstrata.core.config import CacheConfig
from kvstrata.core.machine import available_memory
from kvstrata.kvcache.buffers import KVCacheSpec
from kvstrata.model.formats.dense import DenseFormat
from kvstrata.model.loader import LoadPlan
from kvstrata.worker.runner import device_blocks_for, host_blocks_for

logger = logging.getLogger(__name__)

HEADROOM = 512 * 1024**2          # activations of a 512-token step at 8B are ~0.1 GiB; Python, tokenizer, buffers
GiB = 1024**3


def check_memory(plan: LoadPlan, cache: CacheConfig, available: int | None = None,
                 gpu_free: int | None = None) -> None:
    """ValueError, with the figures and what to change, when `plan` and `cache` cannot fit; `available`
    (host bytes) and `gpu_free` default to this machine's."""
    spec = KVCacheSpec.for_model(plan.arch, cache.block_size, plan.dtype)
    kv = device_blocks_for(cache, spec) * spec.bytes_per_block
    host = host_blocks_for(cache, spec) * spec.bytes_per_block
    weights = plan.footprint
    host_available = available_memory() if available is None else available
    if plan.device.type == "cuda":
        free = torch.cuda.mem_get_info(plan.device)[0] if gpu_free is None else gpu_free
        on_device = weights.resident + kv + HEADROOM
        if on_device > free:
            raise ValueError(f"the model does not fit on {plan.device}: {_gib(weights.resident)} of weights + "
                             f"{_gib(kv)} of KV cache against {_gib(free)} free; use a smaller --kv-cache-memory "
                             "or a smaller model")
        need, held = host + HEADROOM, "the host tier"
    else:
        need = max(weights.peak, weights.resident + kv + host) + HEADROOM
        held = (f"{_gib(weights.peak)} at the peak of loading ({weights.peak_reason}), then {_gib(weights.resident)}"
                f" of weights + {_gib(kv)} of device KV + {_gib(host)} of host KV")
    if need <= host_available:
        logger.info("memory: %s needed of %s available", _gib(need), _gib(host_available))
        return
    raise ValueError(f"the model ({weights.parameters / 1e9:.2f}B parameters) does not fit in this machine's memory: "
                     f"it needs {_gib(need)} ({held}, {_gib(HEADROOM)} headroom) and {_gib(host_available)} is "
                     f"available. {_ways_out(plan, kv, host, host_available)}")


def _ways_out(plan: LoadPlan, kv: int, host: int, available: int) -> str:
    """What to change: the KV sizes when the weights alone fit, bf16 weights if they fit, a smaller model."""
    ways = []
    weights = plan.footprint
    if weights.peak + HEADROOM <= available and kv + host > 0:
        room = available - HEADROOM - weights.resident
        ways.append(f"a smaller --kv-cache-memory and --host-cache-memory (together at most {_gib(max(room, 0))})")
    # bf16 is the smallest load: int8 is made from float32 weights, so it peaks higher than float32 itself.
    if plan.device.type == "cpu" and (plan.dtype, plan.quantization) != (torch.bfloat16, "none"):
        bf16 = DenseFormat().footprint(plan.arch, torch.bfloat16, plan.device)
        if max(bf16.peak, bf16.resident + kv + host) + HEADROOM <= available:
            flags = "--quantization none --dtype bfloat16" if plan.quantization == "int8" else "--dtype bfloat16"
            ways.append(f"{flags} ({_gib(bf16.resident)} of weights)")
    ways.append("a smaller model")
    return "Ways out: " + "; ".join(ways) + "."


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
