"""Roofline profiles: a cost model from a hardware description and a model's size, for machines we cannot run.

Compute: 2 FLOPs per parameter per token plus attention FLOPs per query-key pair, at
`flops_efficiency` of peak; memory: the weights once per step plus the KV of every context read,
at `bandwidth_efficiency` of peak; a step costs the slower of the two (`CostModel.step_seconds`
takes the larger of its `compute` and `memory` terms). Peaks are the vendors' figures; links and
efficiencies are estimates, written beside each machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.core.shapes import SHIPPED_SHAPES, parameter_count, shipped_config
from kvstrata.sim.cost_model import CostModel, Link


@dataclass(frozen=True)
class Hardware:
    description: str
    peak_flops: float                # dense 16-bit FLOP/s (fp32 for the CPU)
    memory_bandwidth: float          # bytes per second
    memory_bytes: int
    host_link: Link                  # device <-> host memory
    store_link: Link                 # engine -> store
    flops_efficiency: float = 0.5    # the share of peak a serving engine reaches on large GEMMs
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002   # scheduling, launches and sampling per step


@dataclass(frozen=True)
class ModelSpec:
    description: str
    params: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> float:
        """Q.K and P.V for one query-key pair, every head of every layer."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("NVIDIA H100 SXM 80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, PCIe 5 x16 to host, "
                     "200 Gb/s to the store", 989e12, 3.35e12, 80 * 10**9,
                     host_link=Link(10e-6, 50e9), store_link=Link(100e-6, 25e9)),
    "a100": Hardware("NVIDIA A100 SXM 80GB: 312 TFLOP/s bf16, 2.04 TB/s HBM2e, PCIe 4 x16 to host, "
                     "100 Gb/s to the store", 312e12, 2.039e12, 80 * 10**9,
                     host_link=Link(10e-6, 25e9), store_link=Link(100e-6, 12.5e9)),
    "l4": Hardware("NVIDIA L4 24GB: 121 TFLOP/s bf16, 300 GB/s GDDR6, PCIe 4 x16 to host, 25 Gb/s to the store",
                   121e12, 300e9, 24 * 10**9, host_link=Link(10e-6, 25e9), store_link=Link(200e-6, 3.1e9)),
    "cpu-2core": Hardware("2 x86 cores with AVX2 (~100 GFLOP/s fp32), ~20 GB/s DRAM; host tier is a memcpy, "
                          "the store a local SSD", 100e9, 20e9, 16 * 10**9,
                          host_link=Link(2e-6, 10e9), store_link=Link(100e-6, 1e9),
                          flops_efficiency=0.3, bandwidth_efficiency=0.5, step_overhead_s=0.001),
}

def _shipped(name: str) -> ModelSpec:
    """A shape of kvstrata.core.shapes (the one `--load-format dummy --model NAME` serves), in bf16."""
    config = shipped_config(name)
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    return ModelSpec(f"{name} (GQA {heads}/{kv_heads} heads, {config['num_hidden_layers']} layers), bf16",
                     parameter_count(config), config["num_hidden_layers"], heads, kv_heads,
                     config.get("head_dim") or config["hidden_size"] // heads)


MODELS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("Llama-3-8B (GQA 32/8 heads, 32 layers), bf16", 8.03e9, 32, 32, 8, 128),
    "smollm2-135m": ModelSpec("SmolLM2-135M (GQA 9/3 heads, 30 layers), bf16", 134.5e6, 30, 9, 3, 64),
    **{name: _shipped(name) for name in SHIPPED_SHAPES},
}


def roofline(hardware: str, model: str) -> CostModel:
    """A profile from first principles, for hardware this machine is not."""
    if hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; known: {', '.join(HARDWARE)}")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}")
    hw, spec = HARDWARE[hardware], MODELS[model]
    flops = hw.peak_flops * hw.flops_efficiency
    bandwidth = hw.memory_bandwidth * hw.bandwidth_efficiency
    per_token = 2 * spec.params / flops
    pair = spec.attention_flops_per_pair / flops
    compute = (0.0, per_token, per_token, 0.0, pair, pair, 0.0, 0.0, pair, 0.0, 0.0, pair)
    memory = (spec.weight_bytes / bandwidth, 0.0, 0.0, spec.kv_bytes_per_token / bandwidth, 0.0, 0.0, 0.0, 0.0,
              0.0, 0.0, 0.0, 0.0)
    kv_memory = hw.memory_bytes * 0.9 - spec.weight_bytes
    if kv_memory <= 0:
        raise ValueError(f"{model} does not fit in the memory of {hardware}")
    return CostModel(
        source=(f"roofline: {hardware} ({hw.description}; {hw.flops_efficiency:.0%} of peak FLOP/s, "
                f"{hw.bandwidth_efficiency:.0%} of peak bandwidth) x {model} ({spec.description})"),
        kv_bytes_per_token=spec.kv_bytes_per_token, host_link=hw.host_link, store_link=hw.store_link,
        compute=compute, memory=memory, overhead_s=hw.step_overhead_s,
        device_cache_tokens=int(kv_memory // spec.kv_bytes_per_token))
