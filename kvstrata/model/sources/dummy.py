"""Dummy weights at a real model's shape (`--load-format dummy`): speed at 1B-8B without the weights.

Decode speed depends on the shape of a model (bytes of weights read per token, FLOPs per prompt
token, KV bytes per token), never on the values of its weights, and no weights beyond the default
SmolLM2 can be had on this machine. So, as vLLM and SGLang benchmark with `--load-format dummy`,
kvstrata builds any supported architecture from its real `config.json` with seeded random weights:

- `--model` names one of the real configs shipped in `kvstrata/core/shape_configs/` (`llama-3.2-1b`, `llama-3.1-8b`,
  ...: vocabulary, GQA, tied embeddings, RoPE scaling and biases as the real models have them), a
  `config.json`, or a folder holding one.
- Every tensor comes from its own generator, seeded by the seed and the tensor's name, in float32,
  then cast: the same values whatever order they are made in and whatever the dtype (so a GGUF
  written from them, `benchmarks/peers/dummy_gguf.py`, holds the weights kvstrata serves).
- Projections are uniform with a standard deviation of 1/sqrt(fan-in), so every projection keeps its
  input's scale and the residual stream grows only as sqrt(layers): activations stay finite in bf16
  over a long decode. Norm weights are 1, biases and embeddings small.

The outputs are noise. Benchmarks use fixed output lengths (`ignore_eos`); nothing may report an
acceptance rate or a quality figure from these weights.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.core.shapes import SHAPES_DIR, SHIPPED_SHAPES
from kvstrata.model.arch import ModelArch, describe
from kvstrata.model.arch import tensors as names

EMBEDDING_STD = 0.02
BIAS_STD = 0.02
_MISSING = object()


@dataclass(frozen=True)
class DummySource:
    """Where a dummy model's shape comes from: its name (what the server serves it as), the HF config,
    and a digest of that config (it enters the model fingerprint: two shapes never share KV)."""

    name: str
    config: dict
    digest: str

    @property
    def arch(self) -> ModelArch:
        return describe(self.config)


def dummy_source(model: str | None) -> DummySource:
    """A shipped config by name, a `config.json` path, or a folder holding one; ValueError otherwise."""
    if not model:
        raise ValueError("--load-format dummy needs --model: one of " + ", ".join(SHIPPED_SHAPES)
                         + ", a config.json or a folder holding one")
    if model in SHIPPED_SHAPES:
        path, name = SHAPES_DIR / f"{model}.json", model
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            path, name = path / "config.json", path.name
        else:
            name = path.parent.name if path.name == "config.json" else path.stem
        if not path.is_file():
            raise ValueError(f"--load-format dummy: {model!r} is neither a shipped config ("
                             f"{', '.join(SHIPPED_SHAPES)}) nor a config.json or a folder holding one")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds no JSON object")
    describe(config)                         # ValueError now for an architecture kvstrata cannot run
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return DummySource(name, config, digest)


def tensor_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF checkpoint of `arch`, by its HF name, in checkpoint order."""
    e, i = arch.hidden_size, arch.intermediate_size
    rows = {"q_proj": arch.q_size, "k_proj": arch.kv_size, "v_proj": arch.kv_size, "o_proj": e, "gate_proj": i,
            "up_proj": i, "down_proj": e}
    biases = {"q_proj": arch.attention_bias, "k_proj": arch.attention_bias, "v_proj": arch.attention_bias,
              "o_proj": arch.attention_out_bias}
    shapes: dict[str, tuple[int, ...]] = {names.EMBEDDINGS: (arch.vocab_size, e)}
    for n in range(arch.num_layers):
        shapes |= {name: (arch.head_dim if role in ("q_norm", "k_norm") else e,)
                   for role, name in names.norms(n, arch).items()}
        for module, (fused, _) in names.MODULES.items():
            shapes[f"{names.module(n, module)}.weight"] = (rows[module], arch.projection_shapes()[fused][1])
            if biases.get(module):
                shapes[f"{names.module(n, module)}.bias"] = (rows[module],)
    shapes[names.FINAL_NORM] = (e,)
    if not arch.tie_word_embeddings:
        shapes[names.LM_HEAD] = (arch.vocab_size, e)
    return shapes


def dummy_tensor(name: str, shape: tuple[int, ...], seed: int = 0, norm_style: str = "llama") -> torch.Tensor:
    """One float32 tensor, from a generator seeded by `seed` and the name alone; norms scale by one (a Gemma
    norm's weight w scales by 1 + w)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape) if norm_style == "llama" else torch.zeros(shape)
    if name.endswith(".bias"):
        std = BIAS_STD
    elif name == names.EMBEDDINGS:
        std = EMBEDDING_STD
    else:
        std = shape[-1] ** -0.5                         # fan-in: the projection keeps its input's scale
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))    # CPU seeds keep 32 bits
    bound = std * 3**0.5                                # uniform(-b, b) has std b / sqrt(3)
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


class DummyTensors:
    """The checkpoint of `arch` as the builder consumes it (`in`, `pop`, iteration over what is left), each
    tensor made only when it is popped and cast to `dtype` at once: loading holds the model and one float32
    tensor, never the whole model twice."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, seed: int = 0) -> None:
        self.shapes = tensor_shapes(arch)
        self.norm_style = arch.norm_style
        self.dtype = dtype
        self.seed = seed

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.shapes))

    def __len__(self) -> int:
        return len(self.shapes)

    def pop(self, name: str, default=_MISSING) -> torch.Tensor:
        if name not in self.shapes:
            if default is _MISSING:
                raise KeyError(name)
            return default
        return dummy_tensor(name, self.shapes.pop(name), self.seed, self.norm_style).to(self.dtype)
