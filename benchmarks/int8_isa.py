"""int8 against float32 and llama.cpp's Q8_0 on the same prompts, in one run, naming the CPU.

    .venv/bin/python benchmarks/int8_isa.py                      # this CPU as it is
    .venv/bin/python benchmarks/int8_isa.py --cap avx2           # then again as an AVX2-only CPU would run

For each ISA (this CPU's own, then each --cap, run in a child with kvstrata's and the libraries'
ISA caps, `kvstrata.core.machine.isa_cap_environ`): `kvstrata bench offline --quantization int8
--versus-float32` on the cases, and its int8 kernel choice; once, llama.cpp on a Q8_0 GGUF made from
what we ship (`benchmarks/peers/make_q8_0.py`; needs `benchmarks/peers/install_llamacpp.sh`), which runs
with this CPU's full ISA whatever the cap (its build picks the ISA). Prints the ratios the int8
issue asks for; JSON and logs go to benchmarks/results/int8-<time>/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvstrata.core.machine import ISA_CAPS, isa_cap_environ, machine  # noqa: E402

PEERS = ROOT / "benchmarks" / "peers"
LLAMACPP = PEERS / "venvs" / "llamacpp" / "bin" / "python"


def run(command: list[str], log: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"{command[1]} failed ({done.returncode}); see {log}:\n{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", action="append", default=[], choices=list(ISA_CAPS),
                        help="also run kvstrata as if the CPU stopped at this ISA (repeatable)")
    parser.add_argument("--num-prompts", default="1,32")
    parser.add_argument("--len", type=int, default=128, help="prompt and output tokens (default 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--patience", type=float, default=60.0)
    args = parser.parse_args()

    from kvstrata.bench.cases import write_cases
    from kvstrata.bench.offline import make_cases
    from kvstrata.model.loader import default_model_path

    out = ROOT / "benchmarks" / "results" / f"int8-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True)
    prompts = out / "prompts.json"
    write_cases(prompts, make_cases([int(n) for n in args.num_prompts.split(",")], args.len, args.len,
                                    args.repeats, seed=0))
    common = ["--prompts", str(prompts), "--threads", str(args.threads), "--patience", str(args.patience)]
    print(f"machine: {machine().describe()}", flush=True)
    results: dict[str, dict] = {}
    for cap in [None, *args.cap]:
        name = cap or "native"
        figures = out / f"kvstrata-{name}.json"
        text = run([str(ROOT / ".venv/bin/kvstrata"), "bench", "offline", *common, "--quantization", "int8",
                    "--versus-float32", "--json", str(figures)], out / f"kvstrata-{name}.log",
                   isa_cap_environ(cap) if cap else None)
        results[name] = json.loads(figures.read_text())
        print(f"--- kvstrata, ISA {name}\n{text}", flush=True)
    llama = None
    if LLAMACPP.exists():
        q8_0 = out / "smollm2-q8_0.gguf"
        run([sys.executable, str(PEERS / "make_q8_0.py"), str(q8_0), "--model", str(default_model_path())],
            out / "make-q8_0.log")
        figures = out / "llamacpp-q8_0.json"
        run([str(LLAMACPP), str(PEERS / "offline_llamacpp.py"), *common, "--model", str(q8_0),
             "--json", str(figures)], out / "llamacpp-q8_0.log")
        llama = json.loads(figures.read_text())
        q8_0.unlink()                                     # 140 MB, made again in a second
    else:
        print("(no llama.cpp: run benchmarks/peers/install_llamacpp.sh for the Q8_0 row)")
    print(f"=== int8 on {machine().describe()}")
    for name, data in results.items():
        for ours, fp32 in zip(data["cases"], data["float32"]["cases"]):
            line = (f"ISA {name:>6} {ours['name']:<9} int8 {ours['output_tok_s']:7.1f} tok/s, float32 "
                    f"{fp32['output_tok_s']:7.1f}: {ours['output_tok_s'] / fp32['output_tok_s']:.2f}x")
            peer = next((c for c in llama["cases"] if c["name"] == ours["name"]), None) if llama else None
            if peer:
                line += (f"; llama.cpp Q8_0 {peer['output_tok_s']:7.1f}: "
                         f"{ours['output_tok_s'] / peer['output_tok_s']:.2f}x")
            print(line)
    (out / "summary.json").write_text(json.dumps({"machine": machine().as_dict(), "kvstrata": results,
                                                  "llamacpp_q8_0": llama}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
