"""Load a model (weights, tokenizer, chat template) from a GGUF file or an HF safetensors folder.

    plan_load(ModelConfig) -> LoadPlan        what will be built, nothing read (the memory check asks it first)
    load_model(ModelConfig) -> LoadedModel    the model, built once (kvstrata.model.builder)

The way through the wing: the source (kvstrata.model.sources: the file, a GGUF converted once into an HF-style
folder in the cache, or dummy weights), its description (kvstrata.model.arch), the weight format, dtype and
device the flags resolve to (kvstrata.model.formats.resolve), then the builder.

Cache root: `$KVSTRATA_CACHE_DIR`, else `~/.cache/kvstrata`. It holds converted models (`models/`, with the int8
weights of `--quantization int8`), memoized file hashes (`hashes/`) and the built kernels (`kernels/`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.core.config import ModelConfig
from kvstrata.model import kernels
from kvstrata.model.arch import ModelArch, describe
from kvstrata.model.builder import build
from kvstrata.model.formats import Resolved, WeightFootprint, WeightFormat, resolve, resolve_device
from kvstrata.model.formats.gguf import read_types
from kvstrata.model.formats.int8 import Int8Format
from kvstrata.model.formats.int8_choice import Int8Choice
from kvstrata.model.network.decoder import DecoderModel
from kvstrata.model.sources import Source, open_source
from kvstrata.model.sources.folders import default_model_path, file_sha256

logger = logging.getLogger(__name__)

__all__ = ["LoadPlan", "LoadedModel", "ModelArch", "default_model_path", "describe_runs", "file_sha256", "load_model",
           "plan_load", "resolve_device"]


@dataclass
class LoadedModel:
    model: DecoderModel
    arch: ModelArch
    tokenizer: Any | None             # a transformers tokenizer; None for folders without one
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    fingerprint: str                  # what keys the cache (kvstrata.model.fingerprint)
    name: str
    dtype: torch.dtype
    device: torch.device
    folder: Path | None               # HF-style folder the weights came from (a GGUF's converted copy);
                                      # None for dummy weights
    format: WeightFormat              # the weight format it runs (kvstrata.model.formats)

    @property
    def quantization(self) -> str:
        return self.format.name

    @property
    def int8(self) -> Int8Choice | None:
        """The int8 kernel this CPU runs, and the figures it was chosen by (int8 models only)."""
        return self.format.choice if isinstance(self.format, Int8Format) else None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's format: the model's dtype (each writer and the paged kernel read it so)."""
        return self.dtype

    def runs(self) -> dict[str, str]:
        """What runs: the weight format, the activations' dtype, a step's path and the ISA level our kernels were
        built for here (/v1/models says it; "off" where they do not run: on a GPU, or kernels.off_reason)."""
        on = self.device.type == "cpu" and kernels.off_reason() is None
        return {"quantization": self.format.describe(), "dtype": str(self.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."), "step": self.model.loop.name,
                "kernels": kernels.level().label if on else "off"}

    def describe(self) -> str:
        return describe_runs(self.runs())


def describe_runs(runs: Mapping[str, str]) -> str:
    """`LoadedModel.runs()` in a few words, for the start-up log and the server's ready line."""
    return f"{runs['quantization']}, {runs['dtype']}, {runs['step']} (kernels: {runs['kernels']})"


@dataclass(frozen=True)
class LoadPlan:
    """What `load_model` will build, known before any weight is read: the shape, where, in what dtype."""

    arch: ModelArch
    resolved: Resolved
    footprint: WeightFootprint
    source: Source

    @property
    def device(self) -> torch.device:
        return self.resolved.device

    @property
    def dtype(self) -> torch.dtype:
        return self.resolved.dtype

    @property
    def quantization(self) -> str:
        """What --quantization came to (never "auto")."""
        return self.resolved.format.name


def plan_load(config: ModelConfig) -> LoadPlan:
    """The model `config` names, without loading it (a GGUF file is converted, once); ValueError for
    anything the user can fix. The engine checks the memory it needs with it (kvstrata.worker.memory_check)."""
    config.validate()
    source = open_source(config)
    arch = describe(source.config)
    resolved = resolve(config, arch, read_types(source.folder))
    return LoadPlan(arch, resolved, resolved.format.footprint(arch, resolved.dtype, resolved.device), source)


def load_model(config: ModelConfig) -> LoadedModel:
    """Load weights, tokenizer and chat template; ValueError for anything the user can fix."""
    start = time.perf_counter()
    plan = plan_load(config)
    if config.threads:
        torch.set_num_threads(config.threads)
    source, arch = plan.source, plan.arch
    opened = source.open(arch, plan.dtype)
    model, fingerprint = build(plan.resolved, arch, source, opened, config.batch_invariant, config.compile)
    tokenizer = opened.tokenizer
    loaded = LoadedModel(model, arch, tokenizer, getattr(tokenizer, "chat_template", None), opened.eos_token_ids,
                         fingerprint, source.name, plan.dtype, plan.device, source.folder, plan.resolved.format)
    if plan.resolved.why:
        logger.info("--quantization %s", plan.resolved.why)
    logger.info("loaded %s (%d layers, %s, %s%s) in %.2fs", source.name, arch.num_layers, loaded.describe(),
                plan.device, ", dummy weights" if source.folder is None else "", time.perf_counter() - start)
    return loaded
