"""Resume after restart: a follow-up question over a long document, asked after the server restarted.

    .venv/bin/python benchmarks/resume_after_restart.py                       # llama-3.2-1b, ~4,000 tokens
    .venv/bin/python benchmarks/resume_after_restart.py --systems kvstrata,llama-server --doc-tokens 1000

The scene llama.cpp's users keep asking for (../shared/research/llama-server.md): a conversation over
a ~4,000-token document, the server stopped (an update, a reboot, a crash) and started again, then the
next question. Per system, one after another on the same cores:
1. start the server, warm it up (one unrelated 16-token request: first-request costs are not the cache's),
2. turn 1: the document and a question (token ids, streamed, a fixed-length answer),
3. stop the server (SIGTERM) and start it again, the same warm-up,
4. the follow-up: the document, the question, an answer and a new question; its TTFT is the figure.
Systems: `kvstrata` (the disk store, `make serve`'s flags: its persistence is the default); `llama-server`
as its users start it (its caches are in memory: cold after a restart); `llama-server-slots` with
`--slot-save-path`, turn 1 pinned to slot 0, saved before the stop and restored by hand after (the
restore's seconds are printed beside the TTFT, which does not include them); `vllm` (prefix caching in
memory: cold). The model is `--shape` with dummy weights (llama-server: a GGUF of kvstrata's, `--gguf-type`).
The answer is the same tokens for every system (as a client sends its text back), so the follow-up
reuses exactly the turn-1 prompt. Prints a table and writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

import servers
from kvstrata.bench.client import RequestOptions, Target, request_body, resolve_model, send
from kvstrata.bench.loadgen import wait_mapped
from kvstrata.bench.quiet import wait_quiet
from kvstrata.core.machine import machine

SYSTEMS = ("kvstrata", "llama-server", "llama-server-slots", "vllm")
PORT = 18650
SLOT = 0
logger = logging.getLogger("resume")


def conversation(doc_tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """(turn 1's prompt, the follow-up's prompt): random ids of the tokenizer's ordinary range (the weights
    are dummy: what the text says does not matter, its length does)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]       # noqa: E731
    first = ids(doc_tokens) + ids(24)                                   # the document, a question
    return first, first + ids(64) + ids(24)                             # + the answer, a new question


def start(server: servers.Server, log: Path) -> float:
    server.start(log)
    seconds = server.wait_ready()
    asyncio.run(ask(server, list(range(2000, 2016)), 4))                 # the warm-up
    if server.label == "kvstrata":
        asyncio.run(wait_mapped(Target(server.label, server.url)))
    return seconds


async def ask(server: servers.Server, prompt: list[int], max_tokens: int, **extra) -> dict:
    """One streamed token-id completion; its TTFT, cached tokens and tokens."""
    target = Target(server.label, server.url)
    async with httpx.AsyncClient(timeout=3600) as client:
        body = request_body(await resolve_model(client, target), prompt, max_tokens, RequestOptions())
        result = await send(client, f"{target.api}/completions", {**body, **extra}, len(prompt), 0.0)
    if not result.ok:
        raise RuntimeError(f"{server.label}: {result.error}")
    return {"ttft_s": round(result.ttft, 3), "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens, "output_tokens": result.output_tokens,
            "tpot_s": None if result.tpot is None else round(result.tpot, 5)}


def slot(server: servers.Server, action: str) -> float:
    """llama-server's POST /slots/{id}?action=save|restore; seconds it took."""
    begin = time.perf_counter()
    response = httpx.post(f"{server.url}/slots/{SLOT}", params={"action": action}, json={"filename": "resume.bin"},
                          timeout=600)
    response.raise_for_status()
    return round(time.perf_counter() - begin, 3)


def make_server(name: str, args: argparse.Namespace, scratch: Path) -> servers.Server:
    if name == "kvstrata":
        return servers.kvstrata(name, PORT, "--host-cache-memory", "1GiB", "--store", "disk",
                                "--store-path", str(scratch / "store"), shape=args.shape)
    if name == "llama-server":
        return servers.llama_server(name, PORT, shape=args.shape, gguf_type=args.gguf_type)
    if name == "llama-server-slots":
        return servers.llama_server(name, PORT, "--slot-save-path", str(scratch / "slots"), shape=args.shape,
                                    gguf_type=args.gguf_type)
    return servers.vllm(name, PORT, shape=args.shape)


def run_system(name: str, args: argparse.Namespace, first: list[int], follow_up: list[int], out: Path) -> dict:
    pinned = {"id_slot": SLOT} if name == "llama-server-slots" else {}
    with tempfile.TemporaryDirectory(prefix=f"resume-{name}-") as scratch:
        (Path(scratch) / "slots").mkdir()
        server = make_server(name, args, Path(scratch))
        log = out / f"resume-{name}.log"
        figures: dict = {"system": name}
        try:
            figures["start_s"] = start(server, log)
            figures["busy_before"] = wait_quiet(args.patience, name)
            figures["turn_1"] = asyncio.run(ask(server, first, args.answer_tokens, **pinned))
            if pinned:
                figures["save_s"] = slot(server, "save")
            server.stop()
            figures["restart_s"] = start(server, log)
            if pinned:
                figures["restore_s"] = slot(server, "restore")
            figures["busy_after"] = wait_quiet(args.patience, name)
            figures["follow_up"] = asyncio.run(ask(server, follow_up, 8, **pinned))
        finally:
            server.stop()
    logger.info("%s: %s", name, json.dumps(figures))
    return figures


def table(results: list[dict]) -> str:
    cold = next((r["follow_up"]["ttft_s"] for r in results if r["system"] == "llama-server"), None)
    lines = ["| system | turn 1 TTFT s | follow-up TTFT s | cached | x llama-server cold | restore s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        up = r["follow_up"]
        cached = "?" if up["cached_tokens"] is None else f"{up['cached_tokens']} / {up['prompt_tokens']}"
        ratio = f"{up['ttft_s'] / cold:.3f}" if cold else "-"
        lines.append(f"| {r['system']} | {r['turn_1']['ttft_s']:.2f} | {up['ttft_s']:.3f} | {cached} | {ratio} | "
                     f"{r.get('restore_s', '-')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", help="the dummy shape every system serves")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--doc-tokens", type=int, default=4000)
    parser.add_argument("--answer-tokens", type=int, default=32, help="turn 1's output length")
    parser.add_argument("--gguf-type", default="q8_0", choices=("bf16", "q8_0", "q4_0"), help="llama-server's weights")
    parser.add_argument("--patience", type=float, default=120, help="seconds to wait for other jobs to leave the cores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results") / time.strftime("resume-%Y%m%d-%H%M%S"))
    parser.add_argument("--json", type=Path, default=None, help="default: OUT/resume.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = [n for n in args.systems.split(",") if n]
    if unknown := set(names) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    first, follow_up = conversation(args.doc_tokens, args.seed)
    results = [run_system(name, args, first, follow_up, args.out) for name in names]
    report = {"machine": machine().describe(), "shape": args.shape, "doc_tokens": args.doc_tokens,
              "follow_up_tokens": len(follow_up), "gguf_type": args.gguf_type, "results": results}
    (args.json or args.out / "resume.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"machine: {report['machine']}\nshape {args.shape}, follow-up of {len(follow_up)} tokens "
          f"({args.doc_tokens}-token document); llama-server on {args.gguf_type}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
