"""Speculative decoding on this CPU, in one run: kvstrata's n-gram prompt lookup and OpenAI predicted
outputs beside llama.cpp's prompt-lookup decoding, on the same token ids.

    .venv/bin/python benchmarks/speculative.py                 # ~15 minutes on the 2-core machine
    .venv/bin/python benchmarks/speculative.py --quick         # tiny sizes: checks the pipeline

Single stream (one prompt at a time), greedy, exactly --output-len tokens (EOS ignored):
    code-edit        kvstrata off / each --ngram configuration / the request's prediction (the original
                     file); llama.cpp off / LlamaPromptLookupDecoding for each K (benchmarks/peers/offline_llamacpp.py)
    quote-summary    the same, without predictions
    chat             little to quote: off against ngram (speculation must cost nothing)
Batch: --batch prompts of code-edit at once, off against each ngram configuration (and the last with
--disable-by-batch-size, if given), --batch-repeats batches of their own prompts, the configurations
taking turns on each.

kvstrata runs in bf16 with --batch-invariant, so speculation cannot change a greedy token (the run
checks it: every repeat's outputs must hash alike with and without it). Its configurations are loaded
side by side and take turns on each repeat, so a host that changes speed under the run moves them
alike; each repeat is one prompt (its own, so no repeat finds another in the prefix cache).
Throughput is all output tokens over all repeats' time (submission to last token); prefill included.
llama.cpp serves the Q4_1 GGUF kvstrata's weights come from, through `Llama.generate` (the API its
prompt lookup lives in) with and without the draft; install it with benchmarks/peers/install_llamacpp.sh.

Take the machine's quiet lock around a run where others share the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstrata.bench.cases import CaseResult, OfflineCase, Speculation, write_cases
from kvstrata.bench.grounded import grounded_case
from kvstrata.bench.offline import run_case
from kvstrata.core.config import EngineConfig
from kvstrata.core.machine import machine
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.scheduler.step_cost import MIN_STEPS
from kvstrata.model.loader import default_model_path

LLAMACPP = ROOT / "benchmarks" / "peers" / "venvs" / "llamacpp" / "bin" / "python"


@dataclass
class Figures:
    """One (case, engine configuration) over all its repeats."""

    case: str
    config: str
    output_tokens: int
    elapsed_s: list[float]
    steps: int
    speculation: Speculation | None
    digests: list[str]

    @property
    def tok_s(self) -> float:
        return self.output_tokens / sum(self.elapsed_s)

    @classmethod
    def of(cls, case: str, config: str, results: list[CaseResult]) -> Figures:
        drafts = [r.speculation for r in results if r.speculation]
        total = Speculation(*(sum(getattr(s, f.name) for s in drafts) for f in dataclasses.fields(Speculation)))
        return cls(case, config, sum(r.num_prompts * r.output_len * len(r.elapsed_s) for r in results),
                   [e for r in results for e in r.elapsed_s], sum(r.steps or 0 for r in results),
                   total if drafts else None, [d for r in results for d in (r.output_digests or [])])


def ngram_configs(text: str, disable_by_batch_size: int | None) -> dict[str, dict]:
    """'4:4:2,8:16:2' (K:prompt_lookup_max:prompt_lookup_min each) -> label -> --speculative-config;
    with `disable_by_batch_size`, the last again with it."""
    configs = {}
    for part in text.split(","):
        k, high, low = (int(x) for x in part.split(":"))
        configs[f"kvstrata ngram K={k} n={low}-{high}"] = {"method": "ngram", "num_speculative_tokens": k,
                                                           "prompt_lookup_max": high, "prompt_lookup_min": low}
    if disable_by_batch_size is not None:
        label, last = list(configs.items())[-1]
        configs[f"{label} off>={disable_by_batch_size}"] = {**last, "disable_by_batch_size": disable_by_batch_size}
    return configs


def split(case: OfflineCase) -> list[OfflineCase]:
    """One case per repeat, so configurations can take turns repeat by repeat."""
    return [OfflineCase(case.name, case.output_len, [prompts], [case.predictions[r]] if case.predictions else None)
            for r, prompts in enumerate(case.repeats)]


def measure(engines: dict[str, LLMEngine], cases: list[tuple[OfflineCase, dict[str, str]]]) -> list[Figures]:
    """Each case on each of its configurations (label -> engine), taking turns on every repeat."""
    figures = []
    for case, labels in cases:
        results: dict[str, list[CaseResult]] = {label: [] for label in labels}
        for one in split(case):
            for label, engine in labels.items():
                results[label].append(run_case(engines[engine], one, patience=0.0))
        for name in labels:
            figures.append(Figures.of(case.name, name, results[name]))
            print(f"  {case.name:<16} {name:<36} {figures[-1].tok_s:7.1f} tok/s", flush=True)
    return figures


def run_llamacpp(out: Path, cases: list[OfflineCase], lookups: list[int]) -> list[Figures]:
    """The peer in its own venv on the same token ids; its figures per (case, lookup)."""
    prompts, figures_path = out / "llamacpp-prompts.json", out / "llamacpp.json"
    write_cases(prompts, cases)
    subprocess.run([str(LLAMACPP), str(ROOT / "benchmarks" / "peers" / "offline_llamacpp.py"), "--prompts",
                    str(prompts), "--model", str(default_model_path()), "--threads", "2", "--json", str(figures_path),
                    "--prompt-lookup", ",".join(str(k) for k in lookups)], check=True)
    figures = []
    for c in json.loads(figures_path.read_text())["cases"]:
        case, _, config = c["name"].partition(" x1 ")
        s = c["speculation"]
        result = CaseResult(**{**c, "speculation": Speculation(**s) if s else None})
        figures.append(Figures.of(f"{case} x1", f"llama.cpp {config}", [result]))
    return figures


def make_cases(engine: LLMEngine, args: argparse.Namespace) -> list[OfflineCase]:
    """code-edit, the same prompts with predictions, quote-summary, chat (one prompt at a time), and
    code-edit `args.batch` at once, through `engine`'s chat template."""
    def case(kind: str, n: int, repeats: int, name: str | None = None) -> OfflineCase:
        return grounded_case(kind, n, repeats, args.output_len, engine.chat_prompt, engine.prompts.encode, name)

    edit = case("code-edit", 1, args.repeats)
    return [edit, case("code-edit-predicted", 1, args.repeats, edit.name), case("quote-summary", 1, args.repeats),
            case("chat", 1, args.repeats), case("code-edit", args.batch, args.batch_repeats)]


def table(figures: list[Figures]) -> str:
    """Every figure beside its case's non-speculative one of the same engine."""
    base = {(f.case, f.config.split(" ")[0]): f for f in figures if f.config.endswith(" off")}
    lines = [(f"{'case':<18} {'engine / config':<36} {'out tok/s':>9} {'vs off':>7} {'steps':>6} {'accepted':>8} "
              f"{'mean acc len':>12} {'same tokens':>11}")]
    for f in figures:
        off = base.get((f.case, f.config.split(" ")[0]))
        s = f.speculation
        same = "-" if off is None or off is f else ("yes" if f.digests == off.digests else "NO")
        lines.append(f"{f.case:<18} {f.config:<36} {f.tok_s:>9.1f} {f.tok_s / off.tok_s if off else 1:>6.2f}x "
                     f"{f.steps or '-':>6} {f'{s.acceptance_rate:.0%}' if s else '-':>8} "
                     f"{f'{s.mean_acceptance_length:.2f}' if s else '-':>12} {same:>11}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check the pipeline")
    parser.add_argument("--ngram", default="4:4:2,8:16:2",
                        help="ngram configurations, K:prompt_lookup_max:prompt_lookup_min each, comma-separated "
                             "(default: 4:4:2,8:16:2); llama.cpp's lookup runs with each K")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="also the last ngram configuration with this disable_by_batch_size, in the batch case")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=4, help="prompts per single-stream case (default: 4)")
    parser.add_argument("--batch", type=int, default=32, help="prompts at once in the batch case (default: 32)")
    parser.add_argument("--batch-repeats", type=int, default=3,
                        help="batches of the batch case, the configurations taking turns (default: 3; one batch's "
                             "time moves by 10%% between identical runs on a shared 2-core host)")
    parser.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="kvstrata only")
    parser.add_argument("--output", default=None, help="folder of the results (default: benchmarks/results/spec-TIME)")
    args = parser.parse_args()
    if args.quick:
        args.output_len, args.repeats, args.batch, args.batch_repeats = 24, 1, 4, 1
    out = Path(args.output or ROOT / "benchmarks" / "results" / f"spec-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    ngrams = ngram_configs(args.ngram, None)
    batch_ngrams = ngram_configs(args.ngram, args.disable_by_batch_size)
    print(f"machine: {machine().describe()}", flush=True)
    base = {"dtype": "bfloat16", "batch_invariant": True, "threads": 2, "kv_cache_memory": 1024**3}
    configs = {"kvstrata off": None, **batch_ngrams}
    engines = {name: LLMEngine(EngineConfig.from_options(**base, speculative_config=spec))
               for name, spec in configs.items()}
    for engine in engines.values():        # warm-up, untimed: a served engine has measured its steps (the
        engine.generate([[1000 + i for i in range(16)]] * 4,     # fit drafts pay by needs MIN_STEPS of them)
                        SamplingParams(max_tokens=2 * MIN_STEPS, temperature=0.0, ignore_eos=True))
    edit, predicted, summary, chat, batch = make_cases(engines["kvstrata off"], args)
    each = {name: name for name in ["kvstrata off", *ngrams]}
    figures = measure(engines, [(edit, each), (predicted, {"kvstrata prediction": "kvstrata off"}), (summary, each),
                                (chat, each), (batch, {name: name for name in configs})])
    for engine in engines.values():
        engine.close()
    del engines
    print(table(_fold_prediction(figures)), flush=True)       # kvstrata's, whatever happens to the peer
    if args.llamacpp:
        ks = sorted({spec["num_speculative_tokens"] for spec in ngrams.values()})
        figures += run_llamacpp(out, [edit, summary, chat], [0, *ks])
    text = table(_fold_prediction(figures))
    print(f"\nbfloat16 (--batch-invariant), greedy, {args.output_len} output tokens per prompt, "
          f"{args.repeats} prompts one at a time per single-stream case; ngram K drafts, n = prompt_lookup_min-max; "
          f"llama.cpp Q4_1 via Llama.generate, LlamaPromptLookupDecoding(num_pred_tokens=K) (max_ngram_size 2)")
    print(text)
    (out / "speculative.txt").write_text(text + "\n")
    (out / "speculative.json").write_text(json.dumps({"machine": machine().as_dict(), "args": vars(args),
                                                      "figures": [dataclasses.asdict(f) for f in figures]}, indent=1))
    print(f"wrote {out}/speculative.txt and .json")


def _fold_prediction(figures: list[Figures]) -> list[Figures]:
    """The prediction's figures right after their case's kvstrata configurations."""
    predicted = [f for f in figures if f.config == "kvstrata prediction"]
    rest = [f for f in figures if f.config != "kvstrata prediction"]
    for p in predicted:
        last = max(i for i, f in enumerate(rest) if f.case == p.case and not f.config.startswith("llama.cpp"))
        rest.insert(last + 1, p)
    return rest


if __name__ == "__main__":
    main()
