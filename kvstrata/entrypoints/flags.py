"""Engine flags, generated from the config dataclasses (name, type, default, help, choices), so a new
config field is a new flag and no flag can name a field that does not exist. Every command that
starts an engine (`kvstrata generate`, `serve`, `bench offline`) takes its flags from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable

from kvstrata.core.config import (
    SPECULATIVE_EXAMPLE,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    format_size,
    parse_size,
)

ENGINE_SECTIONS = (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                   ("lora", LoRAConfig))


def _flag_type(field: dataclasses.Field, hint: object) -> Callable[[str], object]:
    if field.metadata.get("size"):
        return parse_size
    if isinstance(hint, types.UnionType):     # X | None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _help_text(field: dataclasses.Field) -> str:
    """The field's help, with its default once: not when the help already tells it, nor for None."""
    text = field.metadata.get("help", "")
    if field.default is None or "default" in text:
        return text
    default = format_size(field.default) if field.metadata.get("size") else field.default or repr(field.default)
    return f"{text} (default: {default})"


def add_section_flags(parser: argparse.ArgumentParser, title: str, section: type) -> None:
    group = parser.add_argument_group(f"{title} options")
    hints = typing.get_type_hints(section)
    for field in dataclasses.fields(section):
        flag = "--" + field.name.replace("_", "-")
        if hints[field.name] is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                               default=field.default, help=_help_text(field))
        elif typing.get_origin(hints[field.name]) is tuple:       # a list of values: --flag A B C (--flag D)
            group.add_argument(flag, dest=field.name, nargs="+", action="extend", default=list(field.default),
                               metavar={"lora_modules": "NAME=PATH", "lora_root": "DIR"}.get(field.name),
                               help=field.metadata.get("help", ""))
        else:
            group.add_argument(flag, dest=field.name, type=_flag_type(field, hints[field.name]),
                               default=field.default, choices=field.metadata.get("choices"),
                               help=_help_text(field))


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    for title, section in ENGINE_SECTIONS:
        add_section_flags(parser, title, section)
    parser.add_argument("--audit-every-step", action="store_true",
                        help="check block conservation and refcounts after every step")
    parser.add_argument("--speculative-config", metavar="JSON", default=None,
                        help="speculative decoding, vLLM's fields: method (ngram: drafts from the request's own "
                             "prompt and output), num_speculative_tokens, prompt_lookup_max, prompt_lookup_min "
                             f"(5 each if unset), disable_by_batch_size; e.g. '{SPECULATIVE_EXAMPLE}' "
                             "(default: off; requests with an OpenAI `prediction` draft from it either way)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    options = {f.name: getattr(args, f.name) for _, section in ENGINE_SECTIONS for f in dataclasses.fields(section)}
    return EngineConfig.from_options(audit_every_step=args.audit_every_step,
                                     speculative_config=args.speculative_config, **options)
