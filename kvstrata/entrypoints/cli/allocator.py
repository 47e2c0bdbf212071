"""`kvstrata serve --allocator`: the server runs on jemalloc where it can, by re-executing itself with
jemalloc preloaded before anything is allocated that matters.

Why: glibc's malloc gives memory back to the OS only in whole free pages, and a server's heaps fill with
small long-lived chunks between big transient ones (a step's activations, store records), so its free
bytes keep rising for the first 20-25 minutes of traffic and level off at ~100-125 MiB (BENCHMARKS.md,
the long haul, Zen 5 section). jemalloc keeps allocations of a size together and returns dirty pages on
a timer (`background_thread:true`), and vLLM's CPU docs ask for tcmalloc preloaded for the same reason.
`make install` unpacks Debian's libjemalloc2 into the venv (no root); an operator's own library can be
named by KVSTRATA_JEMALLOC. The process keeps its pid (execve), so a supervisor sees one process.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV_LIBRARY = "KVSTRATA_JEMALLOC"              # a libjemalloc.so.2 to use instead of the places below
ENV_DONE = "KVSTRATA_ALLOCATOR_CHOSEN"         # set in the re-executed process: never re-execute twice
DEFAULT_CONF = "background_thread:true"         # freed pages go back to the OS on a timer, even when idle
SEARCH = [Path(sys.prefix) / "jemalloc" / "usr" / "lib", Path("/usr/lib"), Path("/usr/lib64"), Path("/usr/local/lib")]

logger = logging.getLogger(__name__)


def find_jemalloc(environ: Mapping[str, str] = os.environ) -> Path | None:
    """KVSTRATA_JEMALLOC, or the venv's unpacked copy, or the system's libjemalloc.so.2; None if none."""
    if environ.get(ENV_LIBRARY):
        named = Path(environ[ENV_LIBRARY])
        if not named.is_file():
            raise ValueError(f"{ENV_LIBRARY}={named} is not a file")
        return named
    for root in SEARCH:
        found = sorted(root.glob("libjemalloc.so.2")) + sorted(root.glob("*/libjemalloc.so.2"))
        if found:
            return found[0]
    return None


def reexec_environ(choice: str, environ: Mapping[str, str] = os.environ) -> dict[str, str] | None:
    """The environment to re-execute this process in with jemalloc preloaded, or None to go on as is
    (glibc chosen, jemalloc already in, or `auto` and none found). ValueError for `jemalloc` and none found."""
    if choice == "glibc" or environ.get(ENV_DONE) or "jemalloc" in environ.get("LD_PRELOAD", ""):
        return None
    library = find_jemalloc(environ)
    if library is None:
        if choice == "jemalloc":
            raise ValueError("--allocator jemalloc: no libjemalloc.so.2 found (make install unpacks one into the "
                             f"venv; or apt install libjemalloc2, or set {ENV_LIBRARY}=/path/to/libjemalloc.so.2)")
        logger.info("no jemalloc found: serving on glibc's malloc (see --allocator)")
        return None
    preload = " ".join(filter(None, [str(library), environ.get("LD_PRELOAD", "")]))
    return {**environ, "LD_PRELOAD": preload, "MALLOC_CONF": environ.get("MALLOC_CONF", DEFAULT_CONF), ENV_DONE: "1"}


def run_on_jemalloc(choice: str, argv: list[str]) -> None:
    """Replace this process with `python -m kvstrata ARGV` on jemalloc when `reexec_environ` says so."""
    environ = reexec_environ(choice)
    if environ is not None:
        logger.info("re-executing on jemalloc (%s)", environ["LD_PRELOAD"].split()[0])
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "kvstrata", *argv], environ)
