"""`kvstrata bench serve | offline`: the benchmark's command line (registered in `kvstrata.entrypoints.cli.main`).

    kvstrata bench serve --base-url http://127.0.0.1:8000 --compare-url http://127.0.0.1:8001 \\
        --workload shared-prefix --request-rate 2 --num-requests 64 --seed 0 --slo ttft=2000,tpot=200
    kvstrata bench serve --base-url http://127.0.0.1:8000 --request-rate 0.5,1,2,inf --slo ttft=2000,tpot=200
    kvstrata bench offline --num-prompts 1,32 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvstrata.bench.grounded import GROUNDED
from kvstrata.bench.workloads import WORKLOADS, Workload, WorkloadOptions, build_workload

if TYPE_CHECKING:
    from kvstrata.bench.client import Target

# The load generator, client and report are imported where they run: every `kvstrata` command
# builds this parser, and `kvstrata serve` should not pay for httpx and the report at start.

RESULTS_DIR = Path("benchmarks/results")


def add_bench(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmark a server (any OpenAI-compatible one) or the engine")
    kinds = parser.add_subparsers(title="benchmarks", required=True, metavar="BENCH")
    _add_serve(kinds)
    _add_offline(kinds)


# ---- serve --------------------------------------------------------------------------------------
def _rate(text: str) -> float:
    return math.inf if text.strip().lower() in ("inf", "infinity") else float(text)


def _rates(text: str) -> list[float]:
    """'0.5,1,inf' -> [0.5, 1.0, inf]: one rate runs as always, several are a sweep."""
    try:
        rates = [_rate(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write rates per second, comma-separated (inf: all at once)")
    if not rates or any(not rate > 0 for rate in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: every rate must be positive")
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"{text!r}: a rate appears twice")
    return rates


def _add_serve(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("serve", help="streamed requests against OpenAI-compatible servers, side by side")
    p.add_argument("--base-url", required=True, help="server under test, e.g. http://127.0.0.1:8000")
    p.add_argument("--compare-url", action="append", default=[],
                   help="another server to run on the same request sequence (repeatable); ratios are base/other")
    p.add_argument("--label", action="append", default=[], help="names of the servers, in the order given")
    p.add_argument("--model", default=None, help="model name to send (default: the first of each server's /v1/models)")
    p.add_argument("--workload", default="random", help=f"{', '.join(WORKLOADS)} or trace:PATH (Mooncake jsonl)")
    p.add_argument("--request-rate", type=_rates, default="inf",
                   help="sessions started per second, or inf for all at once (default: inf); several, comma-"
                        "separated (0.5,1,2,inf), sweep: the same requests at each rate, then a summary and a PNG "
                        "of p99 TTFT and TPOT against the rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (and arrivals) (default: 0)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per server, alternating; repeat r uses seed + r (default: 1)")
    p.add_argument("--slo", default=None, help="goodput SLO in ms, e.g. ttft=2000,tpot=200,e2el=30000; goodput "
                                               "(requests/s within every SLO) heads the results beside throughput")
    p.add_argument("--warmup-requests", type=int, default=2, help="short unmeasured requests per server first")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that refuse it); outputs may then stop early")
    p.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not ask for usage in the stream (for servers that refuse stream_options)")
    p.add_argument("--prompt-format", choices=("tokens", "text"), default="tokens",
                   help="send token ids, or text decoded with --tokenizer (for servers that take strings only)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for --prompt-format text "
                                                     "(default: the embedded SmolLM2's)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--patience", type=float, default=0.0,
                   help="seconds each run may wait for other jobs to leave the cores (default: 0, no wait)")
    p.add_argument("--output", default=None, help="path prefix of the .json and .png written "
                                                  f"(default: {RESULTS_DIR}/serve-WORKLOAD-TIME)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--no-timelines", dest="timelines", action="store_false",
                   help="do not fetch the server's timelines of the requests (GET /v1/timelines), which show where "
                        "the slowest requests (by e2e latency and by TTFT) spent their time")
    w = p.add_argument_group("workload options")
    defaults = WorkloadOptions()
    for field in dataclasses.fields(WorkloadOptions):
        flag = "--" + field.name.replace("_", "-")
        kind = float if isinstance(field.default, float) else int
        w.add_argument(flag, dest=field.name, type=kind, default=getattr(defaults, field.name),
                       help=f"{field.metadata['help']} (default: {getattr(defaults, field.name)})")
    p.set_defaults(run=run_serve)


def _targets(args: argparse.Namespace) -> list[Target]:
    from kvstrata.bench.client import Target

    urls = [args.base_url, *args.compare_url]
    if args.label and len(args.label) != len(urls):
        raise ValueError(f"{len(args.label)} labels for {len(urls)} servers")
    labels = args.label or [url.split("//")[-1].rstrip("/") for url in urls]
    if len(set(labels)) != len(labels):
        raise ValueError("server labels must differ")
    return [Target(label, url, args.model) for label, url in zip(labels, urls)]


def _workload_builder(args: argparse.Namespace) -> Callable[[int], Workload]:
    """seed -> workload; a trace's repeat r takes the next slice of the trace instead of a new seed."""
    opts = WorkloadOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadOptions)})

    def build(seed: int) -> Workload:
        if args.workload.startswith("trace:"):
            skip = opts.trace_skip + (seed - args.seed) * opts.num_requests
            return build_workload(args.workload, dataclasses.replace(opts, trace_skip=skip), seed)
        return build_workload(args.workload, opts, seed)
    return build


def _decoder(args: argparse.Namespace) -> Callable[[Sequence[int]], str] | None:
    if args.prompt_format == "tokens":
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_model_folder())
    return lambda ids: tokenizer.decode(list(ids))


def default_model_folder() -> Path:
    """The HF-format folder kvstrata converts its default GGUF into (weights, config, tokenizer)."""
    from kvstrata.core.config import cache_dir
    from kvstrata.model.loader import default_model_path, file_sha256
    from kvstrata.model.sources import gguf_convert

    path = default_model_path()
    return gguf_convert.ensure_converted(path, cache_dir(), file_sha256(path))


def run_serve(args: argparse.Namespace) -> int:
    from kvstrata.bench import report
    from kvstrata.bench.client import RequestOptions
    from kvstrata.bench.loadgen import LoadOptions, compare
    from kvstrata.bench.metrics import parse_slo
    from kvstrata.core.machine import machine

    targets = _targets(args)
    slo = parse_slo(args.slo)
    build = _workload_builder(args)
    first = build(args.seed)
    rates = args.request_rate
    if len(rates) > 1 and first.name.startswith("trace:"):
        raise ValueError("a trace brings its own arrival times: sweep --trace-time-scale instead of --request-rate")
    options = RequestOptions(args.ignore_eos, args.include_usage, _decoder(args), args.timeout)
    total = first.num_requests * len(targets) * args.repeats * len(rates)
    from tqdm import tqdm

    print(f"machine: {machine().describe()}")
    points, failed = [], False
    with tqdm(total=total, desc=first.name, unit="req", disable=not args.progress) as bar:
        for index, rate in enumerate(rates):         # the same requests at every rate; servers warmed once
            load = LoadOptions(rate, args.burstiness, args.max_concurrency, args.warmup_requests if not index else 0)
            runs = asyncio.run(compare(targets, build, load, options, args.seed, args.repeats, args.patience,
                                       lambda: bar.update(), args.timelines))
            summary = report.summarize(runs, slo)
            slowest = report.tails(runs) if args.timelines else None
            with bar.external_write_mode():
                if len(rates) > 1:
                    print(f"\n== request rate {report.rate_name(rate)}/s ==")
                _print_run(args, first, rate, summary, slowest, slo)
            points.append((rate, runs, summary, slowest))
            failed = failed or any(m.failed for m in summary.values())
    prefix = str(args.output or RESULTS_DIR / f"serve-{first.name.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}")
    json_path, png_path = Path(prefix + ".json"), Path(prefix + ".png")      # a prefix may hold dots (a rate)
    config = {"workload": first.name, "workload_params": first.params, "num_requests": first.num_requests,
              "turn_gap_s": first.turn_gap, "request_rate": rates[0] if len(rates) == 1 else rates,
              "burstiness": args.burstiness,
              "max_concurrency": args.max_concurrency, "seed": args.seed, "repeats": args.repeats,
              "slo_s": slo, "ignore_eos": args.ignore_eos, "prompt_format": args.prompt_format,
              "patience_s": args.patience, "timelines": args.timelines,
              "targets": [dataclasses.asdict(t) for t in targets]}
    if len(rates) == 1:
        _, runs, summary, slowest = points[0]
        report.write_json(json_path, report.to_json(runs, summary, config, slowest))
        report.plot(png_path, runs, summary,
                    f"{first.name}: {first.num_requests} requests, {_arrivals(first, rates[0])}")
    else:
        sweep = [(rate, summary) for rate, _, summary, _ in points]
        print(f"\nsweep of {first.name}, {first.num_requests} requests x {args.repeats} repeats per rate "
              f"({'SLO ' + report.slo_text(slo) if slo else 'no SLO: goodput needs --slo'}):")
        print(report.sweep_table(sweep))
        report.write_json(json_path, report.sweep_json(points, config))
        report.plot_sweep(png_path, sweep,
                          f"{first.name}: {first.num_requests} requests x {args.repeats} repeats per rate")
    print(f"wrote {json_path} and {png_path}")
    return 1 if failed else 0


def _arrivals(first: Workload, rate: float) -> str:
    return "trace times" if first.name.startswith("trace:") else f"rate {rate}/s"


def _print_run(args: argparse.Namespace, first: Workload, rate: float, summary: dict, slowest: dict | None,
               slo: dict[str, float]) -> None:
    """One rate's results: the workload, the table, the headline and where the slowest requests' time went."""
    from kvstrata.bench import report

    print(f"workload {first.name} {json.dumps(first.params)}: {first.num_requests} requests x {args.repeats} "
          f"repeats, {_arrivals(first, rate)}, max concurrency {args.max_concurrency}")
    print(report.table(summary))
    print(report.headline(summary, slo))
    for tails in (slowest or {}).values():
        print()
        print(tails.table())


# ---- offline ------------------------------------------------------------------------------------
def _add_offline(kinds: argparse._SubParsersAction) -> None:
    from kvstrata.entrypoints.flags import add_engine_flags

    p = kinds.add_parser("offline", help="prompts through the Python API: throughput and weight bandwidth")
    p.add_argument("--prompts", default=None, help="prompts file (see kvstrata/bench/cases.py); "
                                                   "default: draw --num-prompts x --input-len")
    p.add_argument("--workload", default="random", choices=("random", *GROUNDED),
                   help="random token ids (--input-len each), or chat prompts whose replies quote or edit them "
                        "(code-edit, code-edit-predicted: with OpenAI predictions, quote-summary) or do not (chat), "
                        "for speculative decoding (kvstrata/bench/grounded.py) (default: random)")
    p.add_argument("--num-prompts", default="1,32", help="batch sizes, comma-separated (default: 1,32)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of --workload random (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (default: 128)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per case, new prompts each (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (and arrivals) (default: 0)")
    p.add_argument("--json", default=None, help="write the figures here too")
    p.add_argument("--patience", type=float, default=0.0,
                   help="seconds each repeat may wait for other jobs to leave the cores (default: 0, no wait)")
    p.add_argument("--versus-float32", action="store_true",
                   help="then run the same cases on the same engine in float32 without quantization, and print "
                        "the ratios (e.g. with --quantization int8)")
    add_engine_flags(p)
    p.set_defaults(run=run_offline)


def run_offline(args: argparse.Namespace) -> int:
    from kvstrata.bench import report
    from kvstrata.bench.cases import read_cases
    from kvstrata.bench.grounded import grounded_case
    from kvstrata.bench.offline import make_cases
    from kvstrata.bench.offline import run_offline as run
    from kvstrata.core.machine import machine
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.entrypoints.flags import engine_config

    sizes = [int(n) for n in args.num_prompts.split(",")]
    if args.prompts:
        cases = read_cases(args.prompts)
    elif args.workload == "random":
        cases = make_cases(sizes, args.input_len, args.output_len, args.repeats, args.seed)
    print(f"machine: {machine().describe()}", flush=True)
    configs = [engine_config(args)]
    if args.versus_float32:
        model = dataclasses.replace(configs[0].model, quantization="none", dtype="float32")
        configs.append(dataclasses.replace(configs[0], model=model))
    results = []
    for config in configs:                     # one engine at a time: each has the cores to itself
        engine = LLMEngine(config)
        if engine.loaded.int8 is not None:
            print(engine.loaded.int8.summary(), flush=True)
        if not args.prompts and args.workload != "random" and not results:     # the model's chat template
            cases = [grounded_case(args.workload, n, args.repeats, args.output_len, engine.chat_prompt,
                                   engine.prompts.encode) for n in sizes]
        results.append(run(engine, cases, args.patience))
        engine.close()
        del engine
    for figures in results:
        _print_offline(figures)
    if len(results) == 2:
        ours, base = results
        print(f"{_weights_name(ours)} / {_weights_name(base)} output tok/s, same cases, same run: " + ", ".join(
            f"{a['name']} {a['output_tok_s'] / b['output_tok_s']:.2f}x (medians "
            f"{a['median_output_tok_s'] / b['median_output_tok_s']:.2f}x)" for a, b in zip(ours["cases"], base["cases"])))
    if args.json:
        report.write_json(Path(args.json), {**results[0], "machine": machine().as_dict(),
                                            **({"float32": results[1]} if len(results) == 2 else {})})
    return 0


def _weights_name(figures: dict) -> str:
    return figures["dtype"] if figures["quantization"] == "none" else f"{figures['dtype']} {figures['quantization']}"


def _print_offline(figures: dict) -> None:
    from kvstrata.bench.cases import Speculation

    bandwidth = figures["memory_read_gb_s"]
    print(f"kvstrata {_weights_name(figures)}: {figures['weight_bytes'] / 1e6:.0f} MB of weights read per step; "
          f"measured memory read bandwidth {bandwidth:.1f} GB/s")
    print("(figures of the fastest repeat; median output tok/s beside it)")
    width = max(10, *(len(c["name"]) for c in figures["cases"]))
    print(f"{'case':<{width}} {'prompts':>7} {'in/out':>9} {'elapsed s':>18} {'out tok/s':>9} {'(median)':>8} "
          f"{'total tok/s':>11} {'steps':>6} {'ms/step':>7} {'weights GB/s':>12} {'of peak':>7}")
    for c in figures["cases"]:
        runs = ",".join(f"{e:.2f}" for e in c["elapsed_s"])
        print(f"{c['name']:<{width}} {c['num_prompts']:>7} {c['input_len']:>4.0f}/{c['output_len']:<4} {runs:>18} "
              f"{c['output_tok_s']:>9.1f} {c['median_output_tok_s']:>8.1f} {c['total_tok_s']:>11.1f} {c['steps']:>6} "
              f"{1000 * min(c['elapsed_s']) / c['steps']:>7.1f} {c['weight_gb_s']:>12.2f} "
              f"{c['weight_gb_s'] / bandwidth:>7.0%}")
    for c in figures["cases"]:
        if c["speculation"]:
            print(f"{c['name']}: speculative decoding, {Speculation(**c['speculation']).describe()}")
