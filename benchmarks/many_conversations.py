"""More conversations than device KV holds: each turn's TTFT when the working set is 4x the device cache.

    .venv/bin/python benchmarks/many_conversations.py                      # llama-3.2-1b, 24 x ~2,000 tokens
    .venv/bin/python benchmarks/many_conversations.py --conversations 6 --context 300 --systems kvstrata
    .venv/bin/python benchmarks/many_conversations.py --model gemma-3-270m --context 4000 --conversations 16 \
        --systems kvstrata,llama-server        # a real packaged file, served by both as it is

Where the tiers pay: a 1B model recomputes a 2,000-token context in ~13 s on two cores, and reads its KV
(64 MiB) back from host memory or the disk in well under a second. `--conversations` conversations,
each over its own `--context`-token context, one request at a time: first every conversation's first
turn, then `--revisits` turns that go back to them in random order (each conversation equally often),
each turn its whole history (the context, every earlier question and answer) and a new question,
streamed, a fixed-length answer. The answers are the same tokens for every system (a client sends its
text back), so each turn's prompt extends the last. Every system has device KV for about a quarter of
the working set (`--device-share`):
- `kvstrata`: that device cache, a host tier of `--host-share` of the working set and the disk store below;
- `kvstrata-no-tiers`: the device cache alone (prefix caching on; a hybrid shape's sliding layers keep their
  window only, in KV groups);
- `kvstrata-swa-full`: the same with every layer at full length (`--swa-full`; not in the default systems);
- `kvstrata-tiers-swa-full`: `kvstrata` with every layer at full length (not in the default systems either);
- `llama-server`: `-c` of that many tokens (or `--llama-ctx`), as its users start it (`-np 16 -kvu`; its
  host-memory prompt cache, `--cache-ram`, 8 GiB by default, is on), on a GGUF of kvstrata's dummy weights
  (`--gguf-type`); `llama-server-swa-full` the same with `--swa-full` (not in the default systems);
- `vllm`: `--kv-cache-memory-bytes` of that size, prefix caching on (it has no tier below).
Printed per system: revisits' TTFT p50 / p99 / mean, the cached share of their prompt tokens (the
server's usage; llama-server and vLLM report it too), first turns' mean TTFT, every turn's TPOT p50 (one
stream at the conversations' context) and the wall time. With `--model` (a packaged model's name, or a GGUF
file), kvstrata and llama-server both serve that file at its own bits instead of `--shape`'s dummy weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import servers
from resume_after_restart import ask

from kvstrata.bench.client import Target
from kvstrata.bench.loadgen import wait_mapped
from kvstrata.bench.quiet import wait_quiet
from kvstrata.core.config import ModelConfig
from kvstrata.core.machine import machine
from kvstrata.core.shapes import shipped_config
from kvstrata.model.arch import describe
from kvstrata.model.sources import open_source
from kvstrata.model.sources.packaged import PACKAGED, packaged_path

SYSTEMS = ("kvstrata", "kvstrata-no-tiers", "kvstrata-swa-full", "kvstrata-tiers-swa-full", "llama-server",
           "llama-server-swa-full", "vllm")
PORT = 18660
QUESTION, ANSWER = 24, 32
logger = logging.getLogger("conversations")


def turns(conversations: int, context: int, revisits: int, seed: int) -> list[tuple[int, list[int]]]:
    """(conversation, prompt) of every turn in order: each conversation's first, then the revisits."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]       # noqa: E731
    history = [ids(context) for _ in range(conversations)]
    order = list(range(conversations))
    revisit = [c for _ in range(-(-revisits // conversations)) for c in rng.sample(order, conversations)][:revisits]
    plan = []
    for c in order + revisit:
        history[c] = history[c] + ids(QUESTION)
        plan.append((c, list(history[c])))
        history[c] = history[c] + ids(ANSWER)
    return plan


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """bf16 K and V of every layer (llama-server's F16 cache is the same size), of `--model` or `--shape`."""
    if args.model:
        arch = describe(open_source(ModelConfig(model=args.model)).config)
        return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    c = shipped_config(args.shape)
    heads = c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * (c.get("num_key_value_heads") or heads) * \
        (c.get("head_dim") or c["hidden_size"] // heads) * 2


def make_server(name: str, args: argparse.Namespace, scratch: Path, device_bytes: int, host_bytes: int,
                device_tokens: int) -> servers.Server:
    served = {"model": args.model} if args.model else {"shape": args.shape}
    if name in ("kvstrata", "kvstrata-tiers-swa-full"):
        return servers.kvstrata(name, PORT, "--kv-cache-memory", str(device_bytes), "--host-cache-memory",
                                str(host_bytes), "--store", "disk", "--store-path", str(scratch / "store"),
                                *(["--swa-full"] if name.endswith("swa-full") else []), **served)
    if name == "kvstrata-no-tiers":
        return servers.kvstrata(name, PORT, "--kv-cache-memory", str(device_bytes), **served)
    if name == "kvstrata-swa-full":      # a hybrid shape's sliding layers at full length, as before KV groups
        return servers.kvstrata(name, PORT, "--kv-cache-memory", str(device_bytes), "--swa-full", **served)
    if name.startswith("llama-server"):
        gguf = (packaged_path(args.model) if args.model in PACKAGED else Path(args.model)) if args.model else None
        return servers.llama_server(name, PORT, *(["--swa-full"] if name.endswith("swa-full") else []),
                                    shape=None if gguf else args.shape, gguf_type=args.gguf_type,
                                    ctx=args.llama_ctx or device_tokens, gguf=gguf)
    assert not args.model, "vLLM serves dummy shapes only here"
    return servers.vllm(name, PORT, shape=args.shape, kv_bytes=device_bytes, max_model_len=device_tokens)


def run_system(name: str, args: argparse.Namespace, plan: list[tuple[int, list[int]]], out: Path,
               sizes: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"conversations-{name}-") as scratch:
        server = make_server(name, args, Path(scratch), sizes["device_bytes"], sizes["host_bytes"],
                             sizes["device_tokens"])
        figures: dict = {"system": name}
        try:
            server.start(out / f"conversations-{name}.log")
            figures["start_s"] = server.wait_ready()
            asyncio.run(ask(server, list(range(2000, 2016)), 4))             # the warm-up
            if name.startswith("kvstrata"):
                asyncio.run(wait_mapped(Target(name, server.url)))
            figures["busy_before"] = wait_quiet(args.patience, name)
            begin = time.perf_counter()
            figures["turns"] = []
            for index, (conversation, prompt) in enumerate(plan):
                result = asyncio.run(ask(server, prompt, ANSWER))
                figures["turns"].append({"conversation": conversation, **result})
                logger.info("%s turn %d/%d (conversation %d, %d tokens): TTFT %.2f s, %s cached", name, index + 1,
                            len(plan), conversation, len(prompt), result["ttft_s"], result["cached_tokens"])
            figures["wall_s"] = round(time.perf_counter() - begin, 1)
        finally:
            server.stop()
    figures.update(summary(figures["turns"], args.conversations))
    logger.info("%s: %s", name, json.dumps({k: v for k, v in figures.items() if k != "turns"}))
    return figures


def summary(done: list[dict], conversations: int) -> dict:
    revisits = done[conversations:]
    ttft = sorted(t["ttft_s"] for t in revisits)
    tpot = [t["tpot_s"] for t in done if t.get("tpot_s") is not None]
    cached = [t["cached_tokens"] for t in revisits]
    return {"first_turn_ttft_mean_s": round(statistics.mean(t["ttft_s"] for t in done[:conversations]), 3),
            "revisit_ttft_p50_s": round(statistics.median(ttft), 3),
            "revisit_ttft_p99_s": round(ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))], 3),
            "revisit_ttft_mean_s": round(statistics.mean(ttft), 3),
            "tpot_p50_ms": round(1000 * statistics.median(tpot), 2) if tpot else None,
            "revisit_cached_share": None if None in cached else
            round(sum(cached) / sum(t["prompt_tokens"] for t in revisits), 3)}


def table(results: list[dict]) -> str:
    off = next((r for r in results if r["system"] == "kvstrata-no-tiers"), None)
    lines = ["| system | revisit TTFT p50 s | p99 s | mean s | p99 x no tiers | cached share | first turns s "
             "| TPOT p50 ms | wall s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = f"{r['revisit_ttft_p99_s'] / off['revisit_ttft_p99_s']:.2f}" if off else "-"
        share = "?" if r["revisit_cached_share"] is None else f"{r['revisit_cached_share']:.1%}"
        lines.append(f"| {r['system']} | {r['revisit_ttft_p50_s']:.2f} | {r['revisit_ttft_p99_s']:.2f} | "
                     f"{r['revisit_ttft_mean_s']:.2f} | {ratio} | {share} | {r['first_turn_ttft_mean_s']:.2f} | "
                     f"{r['tpot_p50_ms']} | {r['wall_s']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", help="the dummy shape every system serves")
    parser.add_argument("--model", help="a real model every system serves instead (gemma-3-270m, or a GGUF file)")
    parser.add_argument("--systems", default=",".join(s for s in SYSTEMS if not s.endswith("swa-full")),
                        help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--context", type=int, default=2000, help="tokens of each conversation's own context")
    parser.add_argument("--revisits", type=int, default=48, help="turns after every conversation's first")
    parser.add_argument("--device-share", type=float, default=0.25, help="device KV, as a share of the working set")
    parser.add_argument("--host-share", type=float, default=0.5, help="kvstrata's host tier, likewise")
    parser.add_argument("--llama-ctx", type=int, help="llama-server's -c (default: the device KV's tokens)")
    parser.add_argument("--gguf-type", default="q8_0", choices=("bf16", "q8_0", "q4_0"), help="llama-server's weights")
    parser.add_argument("--patience", type=float, default=120, help="seconds to wait for other jobs to leave the cores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("conversations-%Y%m%d-%H%M%S"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = [n for n in args.systems.split(",") if n]
    if unknown := set(names) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    plan = turns(args.conversations, args.context, args.revisits, args.seed)
    per_token = kv_bytes_per_token(args)
    working_set = sum(max(len(p) for c2, p in plan if c2 == c) for c in range(args.conversations)) + ANSWER
    device_tokens = int(working_set * args.device_share)
    sizes = {"working_set_tokens": working_set, "device_tokens": device_tokens,
             "device_bytes": device_tokens * per_token, "host_bytes": int(working_set * args.host_share) * per_token}
    logger.info("working set %d tokens (%.0f MiB); device KV %d tokens (%.0f MiB)", working_set,
                working_set * per_token / 2**20, device_tokens, sizes["device_bytes"] / 2**20)
    results = [run_system(name, args, plan, args.out, sizes) for name in names]
    report = {"machine": machine().describe(), "shape": args.model or args.shape, "conversations": args.conversations,
              "context": args.context, "revisits": args.revisits, "gguf_type": args.gguf_type, **sizes,
              "results": results}
    (args.out / "conversations.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"machine: {report['machine']}\nmodel {report['shape']}: {args.conversations} conversations of {args.context} "
          f"tokens, {args.revisits} revisits; working set {working_set} tokens, device KV {device_tokens} tokens "
          f"({args.device_share:.0%}); llama-server on {args.gguf_type}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
