"""Structured output: a request's output held to a grammar (JSON schema, regex, choice, Lark/GBNF).

The grammars and token masks come from llguidance; nothing here parses JSON or walks a state
machine. `benchmarks/grammar_libs.py` chose it over xgrammar: the masks cost about the same, but
llguidance compiled a nested JSON schema 30x faster (0.6 against 17-21 ms on the busy 2-core
development machine), and a new schema compiles on the request's path; and it is one abi3 wheel
with no dependencies, where xgrammar's asks for triton. The mask is applied by `token_bound` below,
not by either library's kernel.

How a constrained request is served:

    request ──> GrammarSpec (kind, source)  ── compiled once per distinct spec (`compile_grammar`, cached);
                                              a spec the library rejects is a ValueError -> HTTP 400
    each step it samples:
      GrammarMasker.mask(logits, batch)
        rows with a spec only ──> matcher caught up with the request's output tokens (the ledger
                                  is the truth: a step that failed or a preemption never leaves
                                  the matcher ahead or behind)
                               ──> (R, V/32) bitmask filled ──> -inf where forbidden

A batch without constrained rows costs one pass over its requests; a constrained row's raw
logprobs (what the model thinks) are left alone, as vLLM reports them.

What a mask costs a step is measured by `benchmarks/structured_mask.py`: small beside the sampler
step for a JSON schema, where llguidance's token slices cover the strings; a pattern they do not
cover (a regex over letters) walks the whole vocabulary for each row, the case where masks cost
most. The figures: docs/design/structured-output.md.
"""

from __future__ import annotations

import functools
import json
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstrata.core.errors import RequestRejected
from kvstrata.core.sampling_params import GrammarSpec

if TYPE_CHECKING:
    from kvstrata.core.request import Request

logger = logging.getLogger(__name__)

# llguidance's name for each kind of source text.
_FORMATS: dict[str, str] = {"json_schema": "json_schema", "json_object": "json_schema", "regex": "regex",
                            "choice": "choice", "grammar": "grammar"}
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): no run of newlines for a small
# model to lose itself in, and the spacing it saw most in training (SmolLM2 closed more small objects
# in time this way than with no spaces at all: docs/design/structured-output.md).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compile_grammar(spec: GrammarSpec) -> str:
    """llguidance's serialized grammar for `spec` (compiled once per distinct spec); RequestRejected
    (a ValueError, nothing queued) with the library's message when it refuses the spec."""
    grammar, error = _compile(spec.kind, spec.source)
    if error:
        raise RequestRejected(f"{spec.param}: the {spec.kind.replace('_', ' ')} was rejected: {error}", spec.param)
    return grammar


@functools.lru_cache(maxsize=256)
def _compile(kind: str, source: str) -> tuple[str, str]:
    """(grammar, error message or ""); cached, so repeated schemas compile once."""
    import llguidance
    try:
        if kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        elif kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=_JSON_OPTIONS)
        else:
            grammar = llguidance.grammar_from(_FORMATS[kind], source)
    except (ValueError, TypeError) as exc:
        return "", str(exc)
    return grammar, llguidance.LLMatcher.validate_grammar(grammar)


@dataclass
class _MatcherState:
    """One request's matcher and how many of its output tokens it has consumed."""

    matcher: Any                     # llguidance.LLMatcher
    consumed: int = 0


@dataclass
class GrammarMasker:
    """Masks the logits of constrained requests; built once per runner, its tokenizer view on first use.

    Holds one matcher per live constrained request, keyed weakly by the Request, so a finished
    request's matcher goes with it and nothing here needs a release call.
    """

    tokenizer: Any                   # the model's HF tokenizer
    vocab_size: int                  # width of the logits (the model's vocabulary)
    eos_token_ids: tuple[int, ...]
    # Fill masks on llguidance's thread pool from this many rows on: below it, one by one was faster on
    # busy shared cores (docs/design/structured-output.md); vLLM also fills one by one below 128 rows.
    parallel_from: int = 128
    threads: int = 2
    _ll: Any = field(default=None, init=False, repr=False)           # llguidance.LLTokenizer
    _executor: Any = field(default=None, init=False, repr=False)
    _states: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary, init=False, repr=False)

    def mask(self, logits: torch.Tensor, requests: Sequence[Request], in_place: bool) -> torch.Tensor:
        """`logits` (S, V) with every constrained row's forbidden tokens at -inf. Unconstrained rows
        are untouched; `in_place` False copies the logits first (when they are still the raw ones).

        A row of a speculative step scores the token after some draft tokens (`Drafted`: its
        `request` and `drafts`): its mask is the grammar's after those drafts, consumed and rolled
        back. Past a draft the grammar refuses, the mask is the state before it; that row is never
        used, since the refused draft's own row forbids it, so verification rejects it."""
        rows = [i for i, r in enumerate(requests) if r.sampling.structured is not None]
        if not rows:
            return logits
        bitmask = torch.empty(len(rows), (self.vocab_size + 31) // 32, dtype=torch.int32)   # (R, V/32)
        row_bytes = bitmask.shape[1] * 4
        drafted = [_drafted(requests[i]) for i in rows]
        matchers = [self._caught_up(request) for request, _ in drafted]
        plain = [(j, m) for j, (m, (_, drafts)) in enumerate(zip(matchers, drafted)) if not drafts]
        if len(plain) < self.parallel_from:
            for j, matcher in plain:
                matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + j * row_bytes, row_bytes)
        else:
            self._executor.unsafe_compute_mask_ptr([(m, j) for j, m in plain], bitmask.data_ptr(), row_bytes,
                                                   len(matchers))
        for j, (matcher, (_, drafts)) in enumerate(zip(matchers, drafted)):
            if drafts:
                consumed = matcher.try_consume_tokens(list(drafts))
                matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + j * row_bytes, row_bytes)
                matcher.rollback(consumed)
        for j, matcher in enumerate(matchers):
            if matcher.is_error():      # a parser limit hit mid-answer: end this answer, not the whole step
                bitmask[j] = 0
                for eos in self.eos_token_ids:
                    bitmask[j, eos // 32] |= _bit(eos % 32)
        return apply_bound(logits, rows, token_bound(bitmask, self.vocab_size), in_place)

    def _caught_up(self, request: Request) -> Any:
        """The request's matcher, made on first use and fed the output tokens it has not seen."""
        state = self._states.get(request)
        if state is None:
            state = self._states[request] = _MatcherState(self._new_matcher(request.sampling.structured))
        pending = request.output_token_ids[state.consumed:]
        if pending:
            if not state.matcher.consume_tokens(pending):
                logger.warning("%s: its grammar failed (%s); only EOS may follow", request.request_id,
                               state.matcher.get_error())
            state.consumed += len(pending)
        return state.matcher

    def _new_matcher(self, spec: GrammarSpec) -> Any:
        import llguidance
        import llguidance.hf
        if self._ll is None:       # a fraction of a second per vocabulary: paid by the first constrained request
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                    eos_token=list(self.eos_token_ids))
            self._executor = llguidance.LLExecutor(num_threads=self.threads)
        matcher = llguidance.LLMatcher(self._ll, compile_grammar(spec), log_level=0)
        if matcher.is_error():          # masked to EOS only, like a grammar that fails later
            logger.warning("a grammar failed with this tokenizer: %s", matcher.get_error())
        return matcher


def _drafted(row: Any) -> tuple[Request, tuple[int, ...]]:
    """A row's request and the draft tokens it scores the token after: a speculative step's rows are
    views of their request with some drafts taken (kvstrata.worker.speculative.Drafted), others the
    request itself."""
    return getattr(row, "request", row), tuple(getattr(row, "drafts", ()))


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if index == 31 else 1 << index


def token_bound(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    """(R, W) int32 bitmask (token t allowed iff bit t % 32 of word t // 32 is set) -> (R, V) float32
    upper bounds: +inf where allowed, -inf where not, so `minimum(logits, bound)` applies the mask."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]   # (R, V)
    bound = bits.astype(np.float32)
    bound *= 2
    bound -= 1
    bound *= np.inf
    return bound


def apply_bound(logits: torch.Tensor, rows: list[int], bound: np.ndarray, in_place: bool) -> torch.Tensor:
    """`logits` (S, V) with `rows` capped by `bound` (R, V); a copy unless `in_place`.

    On CPU this runs in numpy, one thread: a 2-thread torch op of this size waits for a busy second
    core (torch.minimum at (1, 49152): 20 ms against numpy's 0.002 ms on the shared 2-core machine;
    the figures: docs/design/structured-output.md).
    """
    if logits.device.type != "cpu":
        capped = torch.from_numpy(bound).to(logits.device)
        out = logits if in_place else logits.clone()
        index = torch.tensor(rows, device=logits.device)
        out[index] = torch.minimum(out[index], capped)
        return out
    assert logits.dtype == torch.float32, "the sampler's logits are float32"
    out = logits.numpy() if in_place else logits.numpy().copy()
    if len(rows) == out.shape[0]:
        np.minimum(out, bound, out=out)
    else:
        out[rows] = np.minimum(out[rows], bound)
    return logits if in_place else torch.from_numpy(out)


# ---- the HTTP API's ways to ask for it -------------------------------------------------------------
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}


def spec_from_request(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                      guided: dict[str, Any]) -> GrammarSpec | None:
    """The one constraint a request asks for, from OpenAI's `response_format`, vLLM's current
    `structured_outputs` or its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
    (`guided`: those fields by name, None where unset). RequestRejected when malformed or more than one."""
    specs = [spec for spec in (_from_response_format(response_format), _from_structured_outputs(structured_outputs))
             if spec is not None]
    for name, value in guided.items():
        if value is not None:
            specs.append(_from_kind(name.removeprefix("guided_").replace("json", "json_schema"), value, name))
    if len(specs) > 1:
        raise RequestRejected(f"ask for one constraint at a time, not {' and '.join(s.param for s in specs)}",
                              specs[1].param)
    return specs[0] if specs else None


def _from_kind(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json_schema":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as exc:
            raise RequestRejected(f"{param}: the schema is not valid JSON: {exc}", param) from exc
        return GrammarSpec.json_schema(schema, param)
    if kind == "choice":
        return GrammarSpec.choice(value, param)
    if kind == "json_object":
        if value is not True:
            raise RequestRejected(f"{param}: json_object must be true", param)
        return GrammarSpec("json_object", "", param)
    if not isinstance(value, str) or not value:
        raise RequestRejected(f"{param}: must be a non-empty string", param)
    return GrammarSpec(kind, value, param)


def _from_response_format(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    param = "response_format"
    if response_format is None or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict) or "schema" not in body:
            raise RequestRejected('response_format: json_schema needs {"name": ..., "schema": {...}}', param)
        return GrammarSpec.json_schema(body["schema"], param)       # "strict" or not, the schema is enforced
    raise RequestRejected(f"response_format: type must be text, json_object or json_schema, not {kind!r}", param)


def _from_structured_outputs(options: dict[str, Any] | None) -> GrammarSpec | None:
    if options is None:
        return None
    unknown = sorted(set(options) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise RequestRejected(f"structured_outputs: {', '.join(unknown)} not supported; use one of "
                              f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}", "structured_outputs")
    given = [(key, value) for key, value in options.items() if value is not None]
    if len(given) != 1:
        raise RequestRejected("structured_outputs: give exactly one of " + ", ".join(STRUCTURED_OUTPUTS_KEYS),
                              "structured_outputs")
    key, value = given[0]
    return _from_kind(STRUCTURED_OUTPUTS_KEYS[key], value, "structured_outputs")
