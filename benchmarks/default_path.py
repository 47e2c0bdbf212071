"""The default's speed on a CPU without native bf16: one stream of `kvstrata bench offline` on the shipped file,
by default and with each explicit --dtype, under an ISA cap that hides bf16 (or none), this tree beside a git
revision, in turns.

    .venv/bin/python benchmarks/default_path.py --cap avx512_vnni --before d87be77
    .venv/bin/python benchmarks/default_path.py --cap none                      # this CPU as it is

The cap (kvstrata.core.machine.isa_cap_environ) tells kvstrata, oneDNN, FBGEMM and ATen that the CPU stops at
that level: `avx512_vnni` is an Intel Ice Lake or Cascade Lake Xeon (AVX-512 + VNNI, no bf16), the CPUs where
`--dtype auto` used to pick float32 and the Python loop. Each configuration runs in a process of its own, in
turns, --rounds times; prints the best tok/s of each (bench offline's own figure is the fastest of its
--repeats) and the time a token it means, with the format, dtype and path each ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstrata.core.machine import ISA_CAPS, isa_cap_environ  # noqa: E402

DTYPES = ("auto", "bfloat16", "float32")


def run(tree: Path, dtype: str, cap: str | None, args: argparse.Namespace, out: Path) -> tuple[float, str]:
    """One `bench offline` run of `tree`: its best tok/s and what its start-up said it runs."""
    env = {**os.environ, "PYTHONPATH": str(tree), **(isa_cap_environ(cap) if cap else {})}
    subprocess.run([sys.executable, "-m", "kvstrata", "bench", "offline", "--num-prompts", "1",
                           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                           "--repeats", str(args.repeats), "--dtype", dtype, "--json", str(out)],
                          cwd=tree, env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.read_text())
    said = f"{result['quantization']}, {result['dtype']}, {result.get('runs', {}).get('step', 'its loop')}"
    return max(case["output_tok_s"] for case in result["cases"]), said


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cap", default="avx512_vnni", choices=[*ISA_CAPS, "none"])
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cap = None if args.cap == "none" else args.cap
    best: dict[tuple[str, str], tuple[float, str]] = {}
    with tempfile.TemporaryDirectory(prefix="kvstrata-default-") as scratch:
        trees = [("after", ROOT)]
        if args.before:
            old = Path(scratch) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=ROOT, check=True,
                           capture_output=True)
            trees.insert(0, ("before", old))
        try:
            for round_ in range(args.rounds):
                for side, tree in trees if round_ % 2 == 0 else trees[::-1]:
                    for dtype in DTYPES:
                        tok_s, said = run(tree, dtype, cap, args, Path(scratch) / "offline.json")
                        print(f"round {round_ + 1}: {side:6} --dtype {dtype:8} {tok_s:7.1f} tok/s ({said})", flush=True)
                        key = (side, dtype)
                        best[key] = max(best.get(key, (0.0, "")), (tok_s, said))
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(Path(scratch) / "tree")], cwd=ROOT)
    print(f"\none stream, {args.input_len} in / {args.output_len} out, ISA cap {args.cap}: best tok/s over "
          f"{args.rounds} rounds (ms a token)")
    for (side, dtype), (tok_s, said) in sorted(best.items()):
        print(f"  {side:6} --dtype {dtype:8} {tok_s:7.1f} tok/s ({1000 / tok_s:5.2f} ms)  runs: {said}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
