"""`kvstrata generate | serve | ...`: the command line (engine flags come from `kvstrata.entrypoints.flags`)."""

from __future__ import annotations

import argparse
import logging
import sys

from kvstrata.engine.heap_trim import pin_mmap_threshold
from kvstrata.entrypoints.cli.bench import add_bench
from kvstrata.entrypoints.cli.calibrate import add_calibrate
from kvstrata.entrypoints.cli.generate import add_generate
from kvstrata.entrypoints.cli.router import add_router
from kvstrata.entrypoints.cli.serve import add_serve
from kvstrata.entrypoints.cli.simulate_flags import add_simulate
from kvstrata.model.formats.onednn import bound_kernel_caches

COMMANDS = [add_generate, add_serve, add_router, add_simulate, add_calibrate, add_bench]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _add_log_level(parser: argparse.ArgumentParser, default: str | None) -> None:
    """--log-level before or after the command (and its sub-commands): the last one given wins."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                        default=default if default is not None else argparse.SUPPRESS,
                        help="log level (default: INFO for serve, WARNING otherwise)")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _add_log_level(sub, None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description="LLM serving with a three-tier KV cache")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(commands)
    _add_log_level(parser, None)
    return parser


def main(argv: list[str] | None = None) -> int:
    pin_mmap_threshold()        # before the first big buffer is freed (kvstrata.engine.heap_trim)
    bound_kernel_caches()       # before any command makes a oneDNN kernel (kvstrata.model.formats.onednn)
    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else None     # a real command line: `serve` may re-execute it
    args.log_level = getattr(args, "log_level", None) or getattr(args, "default_log_level", "WARNING")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"kvstrata: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
