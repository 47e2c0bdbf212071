"""The sources room: where a model's weights, tokenizer and config come from, before any format or network.

    folders.py        the default model, GGUF files and HF folders, file hashes, tokenizers, stop tokens
    gguf_convert.py   a GGUF file converted once into an HF-style folder (its own blocks kept beside it)
    dummy.py          seeded random weights at a real model's shape (`--load-format dummy`)

`open_source` is what the loader asks: a `Source` says what the model is (its HF config) and where its files
are, and makes its checkpoint's tensors on demand.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from kvstrata.core.config import ModelConfig
from kvstrata.model.arch import ModelArch
from kvstrata.model.sources import dummy
from kvstrata.model.sources.folders import (
    eos_token_ids,
    load_tokenizer,
    model_folder,
    safetensors_files,
    tokenizer_folder,
)


@dataclass(frozen=True)
class Source:
    """A model's files: its name, HF config, the folder of its weights (a GGUF's converted copy; None for dummy
    weights), the content ids of its weights (what the fingerprint carries), and `--tokenizer` when given."""

    name: str
    config: dict
    folder: Path | None
    weight_ids: list[tuple[str, str]]
    tokenizer: str | None = None

    def tokenizer_path(self) -> Path:
        """`--tokenizer`'s folder, else the model's own; dummy weights speak the default model's tokenizer (found,
        and converted once, only when the model is loaded: planning a dummy load reads nothing)."""
        if self.tokenizer:
            return tokenizer_folder(self.tokenizer)
        return self.folder or model_folder(None)[0]

    def open(self, arch: ModelArch, dtype: torch.dtype) -> Opened:
        """The files, opened: the checkpoint, the tokenizer (its vocabulary padded to the model's), the stop
        tokens (dummy weights take the tokenizer's: the config's name another vocabulary's tokens)."""
        folder = self.tokenizer_path()
        tokenizer = load_tokenizer(folder, arch.vocab_size)
        eos = eos_token_ids(folder, {} if self.folder is None else self.config, tokenizer)
        return Opened(self.tensors(arch, dtype), tokenizer, eos)

    def tensors(self, arch: ModelArch, dtype: torch.dtype) -> MutableMapping[str, torch.Tensor]:
        """The checkpoint by HF name: the folder's safetensors memory-mapped, or dummy weights made as taken."""
        if self.folder is None:
            return dummy.DummyTensors(arch, dtype)
        tensors: dict[str, torch.Tensor] = {}
        for f in safetensors_files(self.folder):
            tensors.update(safetensors.torch.load_file(f))     # memory-mapped on CPU
        return tensors


@dataclass(frozen=True)
class Opened:
    """What loading reads of a source: its checkpoint by HF name, its tokenizer (None: token ids only) and stop
    tokens."""

    tensors: MutableMapping[str, torch.Tensor]
    tokenizer: Any | None
    eos_token_ids: tuple[int, ...]


def open_source(config: ModelConfig) -> Source:
    """The source `config` names (a GGUF file is converted, once); ValueError for anything the user can fix."""
    if config.load_format == "dummy":
        shape = dummy.dummy_source(config.model)
        name, hf_config, folder, weight_ids = shape.name, shape.config, None, [("dummy", shape.digest)]
    else:
        folder, name, weight_ids = model_folder(config.model)
        hf_config = json.loads((folder / "config.json").read_text())
    if config.tokenizer:
        tokenizer_folder(config.tokenizer)               # checked now: a bad --tokenizer is refused before loading
    return Source(name, hf_config, folder, weight_ids, config.tokenizer)
