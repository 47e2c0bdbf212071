"""Repeated long-prefix workload across cache tiers: where prompt KV comes from, and what TTFT it buys.

Each round serves a request whose prompt is a long shared prefix plus a short question, then
filler requests that push the prefix out of device memory. Configurations:

    device          device cache only (the prefix is recomputed every round)
    device+host     evicted blocks are written back to host memory and loaded back
    device+host+disk   host is small, so the prefix reaches the disk store and loads from it
    device+host+redis  the same with a local redis-server

Run: .venv/bin/python benchmarks/tiers.py [--rounds 6] [--prefix-tokens 1536]
Prints one table row per configuration: hit tokens per tier over the measured rounds, and TTFT
(median over rounds after the first) of the prefix request.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from kvstrata.core.config import EngineConfig, ModelConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.loader import load_model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds until the first token of `prompt`, and its cached prompt tokens."""
    started = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = None
    while engine.has_unfinished:
        if engine.step() and first is None:
            first = time.perf_counter()
    while engine.has_work:
        engine.step()
    return first - started, request.num_cached_tokens


def run(name: str, loaded, options: dict, prefix: list[int], fillers: list[list[int]], rounds: int) -> dict:
    engine = LLMEngine(EngineConfig.from_options(**options), loaded=loaded)
    times = []
    for round_index in range(rounds):
        question = engine.encode(f" Question {round_index}: what comes next?")
        seconds, cached = ttft(engine, prefix + question)
        times.append(seconds)
        for filler in fillers:
            engine.generate([filler], SamplingParams(max_tokens=1, temperature=0.0))
    stats = engine.tiers.stats
    engine.close()
    return {"config": name, "ttft_first_s": times[0], "ttft_median_s": statistics.median(times[1:]),
            **{f"hit_{tier}": tokens for tier, tokens in stats.hit_tokens.items()},
            "prompt_tokens": stats.prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    args = parser.parse_args()

    loaded = load_model(ModelConfig())
    words = ("river castle vineyard harbour meadow lantern orchard compass glacier quarry " * 400).split()
    prefix = loaded.tokenizer.encode(" ".join(words), add_special_tokens=False)[:args.prefix_tokens]
    fillers = [loaded.tokenizer.encode(f"Filler {i}: " + " ".join(words[i * 7:]), add_special_tokens=False)
               [:args.prefix_tokens] for i in range(3)]
    device_blocks = args.prefix_tokens // 16 + 16           # holds one long prompt, not two
    base = dict(block_size=16, num_device_blocks=device_blocks, max_model_len=4096,
                max_num_batched_tokens=512, write_policy="write_back")
    small_host = device_blocks // 4                          # too small to keep the prefix: it goes to the store

    rows = []
    with tempfile.TemporaryDirectory() as disk, tempfile.TemporaryDirectory() as redis_dir:
        configs = [("device", dict(base)),
                   ("device+host", dict(base, num_host_blocks=4 * device_blocks)),
                   ("device+host+disk", dict(base, num_host_blocks=small_host, store="disk", store_path=disk))]
        redis = None
        if shutil.which("redis-server"):
            port = free_port()
            redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", redis_dir], stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            configs.append(("device+host+redis", dict(base, num_host_blocks=small_host,
                                                      store=f"redis://127.0.0.1:{port}/0")))
        try:
            for name, options in configs:
                rows.append(run(name, loaded, options, prefix, fillers, args.rounds))
                print(f"done: {name}", flush=True)
        finally:
            if redis is not None:
                redis.terminate()
                redis.wait()

    print(f"\n{args.rounds} rounds, prefix {len(prefix)} tokens, device cache {device_blocks} blocks of 16 tokens")
    header = f"{'config':<20} {'prompt tok':>10} {'device hit':>10} {'host hit':>9} {'store hit':>9} " \
             f"{'TTFT 1st':>9} {'TTFT median':>11}"
    print(header)
    for row in rows:
        print(f"{row['config']:<20} {row['prompt_tokens']:>10} {row['hit_device']:>10} {row['hit_host']:>9} "
              f"{row['hit_store']:>9} {row['ttft_first_s'] * 1000:>7.0f}ms {row['ttft_median_s'] * 1000:>9.0f}ms")


if __name__ == "__main__":
    main()
