"""A model step before and after a change, in one run: `benchmarks/model_step.py` from a git revision and from
the working tree, in turns.

    .venv/bin/python benchmarks/before_after.py --before d87be77 -- --dtypes gguf bfloat16 int8 --batches 1 32 \\
        --prefills 512

The revision is checked out into a temporary worktree (removed at the end), and each round runs `model_step.py
--json` once with it and once with this tree, in alternating order, each in a process of its own (the old
tree's kernels build into the same cache, under their own names). This VM's memory bandwidth moves by tens of
percent over minutes, so one tree after the other would measure the host as much as the change: the turns
spread that over both. Prints, per step and model, the fastest of every round's fastest (model_step's own
figure is the fastest of --repeat steps) before and after, and after / before.
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


def run_step(tree: Path, args: list[str], out: Path) -> dict:
    """model_step.py of `tree`, on `tree`'s package, its timings by (run, model)."""
    subprocess.run([sys.executable, str(tree / "benchmarks" / "model_step.py"), *args, "--json", str(out)],
                   cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, stdout=subprocess.DEVNULL)
    return {(t["run"], t["model"]): t["fastest_ms"] for t in json.loads(out.read_text())["timings"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision to compare the working tree against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("step_args", nargs=argparse.REMAINDER, help="after --: model_step.py's flags")
    args = parser.parse_args()
    step_args = [a for a in args.step_args if a != "--"]
    best: dict[str, dict[tuple[str, str], float]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory(prefix="kvstrata-before-") as scratch:
        old = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for round_ in range(args.rounds):
                order = [("before", old), ("after", ROOT)] if round_ % 2 == 0 else [("after", ROOT), ("before", old)]
                for side, tree in order:
                    print(f"round {round_ + 1}/{args.rounds}: {side}", flush=True)
                    for key, ms in run_step(tree, step_args, Path(scratch) / f"{side}.json").items():
                        best[side][key] = min(ms, best[side].get(key, ms))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    print(f"\nmodel_step.py {' '.join(step_args)}: fastest ms over {args.rounds} rounds, before ({args.before}) "
          "and after (this tree)")
    for key in sorted(best["after"]):
        before, after = best["before"].get(key), best["after"][key]
        ratio = f"{after / before:.3f}" if before else "-"
        print(f"  {key[0]:>22} {key[1]:>9}: {before or float('nan'):8.2f} -> {after:8.2f}  ({ratio})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
