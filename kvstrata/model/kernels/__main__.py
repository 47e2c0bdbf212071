"""`python -m kvstrata.model.kernels`: build every library for this machine's ISA level (what `make install`
runs). Exits 1 with the compiler's message when one fails; 0, saying why, where the kernels are off."""

from __future__ import annotations

import logging
import sys

from kvstrata.model.kernels.build import SOURCES, KernelBuildError, library, off_reason
from kvstrata.model.kernels.isa import level


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if off_reason() is not None:
        print(f"kvstrata's kernels are off here ({off_reason()}): attention and norms run in torch, and a GGUF "
              "is widened")
        return 0
    for name in SOURCES:
        try:
            built = library(name)
        except KernelBuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{name} ({level().label}): {built.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
