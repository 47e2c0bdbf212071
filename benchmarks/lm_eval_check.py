"""lm-evaluation-harness (PyPI lm-eval) end to end against a kvstrata server, checked against lm-eval's own
`hf` backend on the same fp32 weights.

    benchmarks/peers/install_lmeval.sh                        # once: the lm-eval venv (~2 min, 1.8 GB)
    .venv/bin/python benchmarks/lm_eval_check.py              # starts `kvstrata serve --dtype float32`
    .venv/bin/python benchmarks/lm_eval_check.py --base-url http://127.0.0.1:8000   # a server already up

Four runs (--runs) on the two local tasks in benchmarks/lm_eval_tasks/ (kvs_mc: 32 four-way questions scored
by log-likelihood, 128 requests; kvs_gen: 16 one-word questions, greedy, exact match), one `lm_eval` per task,
so a task the server refuses never hides the other:

    local-completions       kvs_mc + kvs_gen   /v1/completions: echo + logprobs=1 + max_tokens=1 for
                                               log-likelihoods, token-id prompts batched --batch-size a body
    local-chat-completions  kvs_gen            /v1/chat/completions, lm-eval's --apply_chat_template
    hf                      kvs_mc + kvs_gen   transformers in lm-eval's venv, the reference
    hf, chat template       kvs_gen            the reference for the chat run

The check: each kvs_mc log-likelihood (a sum over the choice's tokens, in nats) from local-completions
against hf's, |diff| <= --tolerance (0.02) for all 128, and equal accuracies; exit 1 otherwise, or if any
lm_eval failed. Generations equal to hf's are counted and reported, never gated (greedy ties may break
differently). lm-eval talks to the server through a recording proxy in this process: the first body and
reply of each kind, and the status counts, go to requests/ in the results folder
(benchmarks/results/lm-eval-<time>/), with each run's log, lm-eval's own results and samples, and
summary.json.

What lm-eval 0.4.13 sends (lm_eval/models/openai_completions.py, api_models.py), `seed` 1234 in all:

    log-likelihood  {"model", "prompt": [[ids of context + continuation], ...] (--batch-size of them; text when
                     tokenized_requests=False), "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": true}
                    and reads choices (sorted by "index", one per prompt) -> logprobs.token_logprobs[ctxlen:-1]
                    and top_logprobs[ctxlen:-1]: the echoed prompt AND the one generated token must be there
                    (its last entry is dropped; a server that echoes only the prompt loses the continuation's
                    last token). is_greedy compares each token's logprob with max(top_logprobs) by ==.
    generate_until  {"model", "prompt": [[ids], ...], "max_tokens": max_gen_toks, "temperature": 0, "stop": until
                     (+ "<|im_end|>" only when num_concurrent=1), **whatever else the task's generation_kwargs
                     hold}; reads choices[i].text, which must stop before the stop string.
    chat            {"messages": [{"role": "user", ...}], "model", "max_tokens", "temperature", "stop": until[:4]}.

tokenizer_backend=huggingface is set: lm-eval's default `auto` probes GET /tokenizer_info and POST /tokenize and
would switch to the server's tokenizer once both answer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "benchmarks" / "peers" / "venvs" / "lmeval"
TASKS = ROOT / "benchmarks" / "lm_eval_tasks"
MODEL_NAME = "SmolLM2-135M-Instruct"
PEER_CACHE = Path(os.environ.get("PEER_CACHE", "/tmp/kvstrata-peers-cache"))
RUNS = ("completions", "chat", "hf", "hf-chat")


class Recorder(ThreadingHTTPServer):
    """A forwarding proxy that keeps, per kind of request, the count of each status and the first body and
    reply (kinds: loglikelihood = /v1/completions with echo, generate = without, chat, else the path)."""

    daemon_threads = True

    def __init__(self, upstream: str, folder: Path):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream, self.folder, self.run = upstream.rstrip("/"), folder, "-"
        self.counts: Counter[tuple[str, str, int]] = Counter()
        self.lock = threading.Lock()
        folder.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, path: str, body: bytes | None, status: int, reply: bytes) -> None:
        try:
            request = json.loads(body) if body else None
        except ValueError:
            request = body.decode(errors="replace")
        if path.startswith("/v1/completions"):
            kind = "loglikelihood" if isinstance(request, dict) and request.get("echo") else "generate"
        else:
            kind = "chat" if path.startswith("/v1/chat/completions") else path.strip("/").replace("/", "_")
        with self.lock:
            self.counts[(self.run, kind, status)] += 1
            first = self.counts[(self.run, kind, status)] == 1
        if first:
            try:
                answer = json.loads(reply)
            except ValueError:
                answer = reply.decode(errors="replace")
            (self.folder / f"{self.run}-{kind}-{status}.json").write_text(
                json.dumps({"path": path, "request": request, "status": status, "reply": answer}, indent=1))


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def do_GET(self) -> None:
        self._forward(None)

    def do_POST(self) -> None:
        self._forward(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def _forward(self, body: bytes | None) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
        request = urllib.request.Request(self.server.upstream + self.path, data=body, headers=headers,
                                         method=self.command)
        try:
            with urllib.request.urlopen(request, timeout=900) as reply:
                status, data, ctype = reply.status, reply.read(), reply.headers.get("Content-Type")
        except urllib.error.HTTPError as error:
            status, data, ctype = error.code, error.read(), error.headers.get("Content-Type")
        self.server.record(self.path, body, status, data)
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype or "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):    # lm-eval gave up on this request (another failed)
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(out: Path, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`kvstrata serve --dtype float32` from this checkout on a free port, ready (200 on /health)."""
    port = free_port()
    with open(out / "server.log", "w") as log:      # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", "--port", str(port), "--dtype",
                                 "float32"], env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                stderr=subprocess.STDOUT)
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"kvstrata serve exited with {proc.returncode}: see {out / 'server.log'}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"kvstrata serve not ready after {timeout:.0f}s")


def lm_eval(name: str, model: str, model_args: dict, task: str, out: Path, extra: list[str]) -> dict:
    """One `lm_eval` run in the lm-eval venv, from the repository root (the tasks' data_files are relative to
    it); returns {rc, wall_s, folder}."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    command = [str(VENV / "bin" / "lm_eval"), "--model", model, "--model_args", args, "--tasks", task,
               "--include_path", str(TASKS.relative_to(ROOT)), "--log_samples", "--output_path", str(out / name),
               *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(PEER_CACHE / "hf"),
           "XDG_CACHE_HOME": str(PEER_CACHE / "xdg"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    (out / f"{name}.cmd").write_text(" ".join(command) + "\n")
    started = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    wall = time.monotonic() - started
    print(f"{name}: exit {rc} in {wall:.1f}s (log {out / f'{name}.log'})", flush=True)
    if rc != 0:
        print("".join((out / f"{name}.log").read_text().splitlines(keepends=True)[-4:]), flush=True)
    return {"rc": rc, "wall_s": round(wall, 1), "folder": out / name}


def samples(run: dict | None, task: str) -> dict[int, dict]:
    found = glob.glob(str(run["folder"] / "**" / f"samples_{task}_*.jsonl"), recursive=True) if run else []
    if not found or run["rc"] != 0:
        return {}
    return {d["doc_id"]: d for d in map(json.loads, Path(max(found)).read_text().splitlines())}


def metrics(run: dict, task: str) -> dict[str, float]:
    found = glob.glob(str(run["folder"] / "**" / "results_*.json"), recursive=True)
    if run["rc"] != 0 or not found:
        return {}
    values = json.loads(Path(max(found)).read_text())["results"][task]
    named = {tuple(k.split(",")): v for k, v in values.items() if isinstance(v, float) and "stderr" not in k}
    return {metric if f == "none" else f"{metric}/{f}": v for (metric, f), v in named.items()}


def loglikelihoods(docs: dict[int, dict]) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc, choice) -> (sum of the choice's token log-probs, whether each was the argmax)."""
    return {(doc_id, i): (float(r[0][0]), r[0][1] in (True, "True"))
            for doc_id, d in docs.items() for i, r in enumerate(d["resps"])}


def compare_loglikelihoods(served: dict, reference: dict, tolerance: float) -> dict:
    a, b = loglikelihoods(served), loglikelihoods(reference)
    if not a or a.keys() != b.keys():
        return {"ok": False, "why": f"items: {len(a)} served vs {len(b)} reference"}
    diffs = [abs(a[k][0] - b[k][0]) for k in b]
    acc = [sum(d["acc"] for d in docs.values()) / len(docs) for docs in (served, reference)]
    worst = max(b, key=lambda k: abs(a[k][0] - b[k][0]))
    return {"ok": max(diffs) <= tolerance and acc[0] == acc[1], "items": len(diffs), "max_abs_nats": max(diffs),
            "mean_abs_nats": sum(diffs) / len(diffs), "worst_item": list(worst), "acc_served": acc[0],
            "acc_reference": acc[1], "greedy_equal": sum(a[k][1] == b[k][1] for k in b)}


def same_generations(served: dict, reference: dict) -> str:
    if not served or served.keys() != reference.keys():
        return "-"
    return f"{sum(served[k]['resps'] == reference[k]['resps'] for k in reference)}/{len(reference)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a kvstrata server already up (its root, without /v1); "
                                           "default: start `kvstrata serve --dtype float32` here")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--batch-size", type=int, default=4, help="prompts in one /v1/completions body")
    parser.add_argument("--num-concurrent", type=int, default=2, help="requests lm-eval keeps in flight")
    parser.add_argument("--tokenized-requests", choices=("True", "False"), default="True",
                        help="True: prompts as token ids (lm-eval's default); False: as text the server tokenizes")
    parser.add_argument("--tolerance", type=float, default=0.02, help="nats per item")
    parser.add_argument("--limit", type=int, help="documents per task (lm-eval --limit), for a quick try")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/lm-eval-<time>")
    args = parser.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    if unknown := set(runs) - set(RUNS):
        parser.error(f"unknown runs {sorted(unknown)}")
    if not (VENV / "bin" / "lm_eval").exists():
        parser.error(f"no lm-eval venv at {VENV}: run benchmarks/peers/install_lmeval.sh")
    out = args.out or ROOT / "benchmarks" / "results" / time.strftime("lm-eval-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    sys.path.insert(0, str(ROOT))
    from kvstrata.entrypoints.cli.bench import default_model_folder
    folder = default_model_folder()
    extra = ["--limit", str(args.limit)] if args.limit else []
    done: dict[tuple[str, str], dict] = {}

    if {"completions", "chat"} & set(runs):
        server, base = (None, args.base_url) if args.base_url else start_server(out)
        recorder = Recorder(base, out / "requests")
        threading.Thread(target=recorder.serve_forever, daemon=True).start()
        api = {"model": MODEL_NAME, "num_concurrent": args.num_concurrent, "max_retries": 1, "timeout": 600}
        completions = {**api, "base_url": f"{recorder.url}/v1/completions", "tokenizer": folder,
                       "tokenizer_backend": "huggingface", "tokenized_requests": args.tokenized_requests}
        chat = {**api, "base_url": f"{recorder.url}/v1/chat/completions"}
        try:
            for task in ("kvs_mc", "kvs_gen") if "completions" in runs else ():
                recorder.run = "completions"
                done["completions", task] = lm_eval(f"completions-{task}", "local-completions", completions, task,
                                                    out, [*extra, "--batch_size", str(args.batch_size)])
            if "chat" in runs:
                recorder.run = "chat"
                done["chat", "kvs_gen"] = lm_eval("chat-kvs_gen", "local-chat-completions", chat, "kvs_gen", out,
                                                  [*extra, "--apply_chat_template"])
        finally:
            recorder.shutdown()
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
        (out / "requests" / "counts.json").write_text(json.dumps(
            [{"run": r, "kind": k, "status": s, "n": n} for (r, k, s), n in sorted(recorder.counts.items())],
            indent=1))
    hf = {"pretrained": folder, "dtype": "float32"}
    hf_extra = [*extra, "--device", "cpu", "--batch_size", "8"]
    for task in ("kvs_mc", "kvs_gen") if "hf" in runs else ():
        done["hf", task] = lm_eval(f"hf-{task}", "hf", hf, task, out, hf_extra)
    if "hf-chat" in runs:
        done["hf-chat", "kvs_gen"] = lm_eval("hf-chat-kvs_gen", "hf", hf, "kvs_gen", out,
                                             [*hf_extra, "--apply_chat_template"])
    return report(done, out, args.tolerance)


def report(done: dict[tuple[str, str], dict], out: Path, tolerance: float) -> int:
    print(f"\n{'run':<12} {'task':<8} {'exit':>4} {'wall s':>7}  metrics")
    summary: dict = {"runs": []}
    for (name, task), run in done.items():
        scores = metrics(run, task)
        summary["runs"].append({"run": name, "task": task, **run, "folder": str(run["folder"]), "metrics": scores})
        print(f"{name:<12} {task:<8} {run['rc']:>4} {run['wall_s']:>7.1f}  "
              + " ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    ok = all(r["rc"] == 0 for r in done.values())
    if ("completions", "kvs_mc") in done and ("hf", "kvs_mc") in done:
        check = compare_loglikelihoods(samples(done["completions", "kvs_mc"], "kvs_mc"),
                                       samples(done["hf", "kvs_mc"], "kvs_mc"), tolerance)
        summary["loglikelihood"] = check
        ok = ok and check["ok"]
        if "max_abs_nats" in check:
            print(f"\nkvs_mc log-likelihoods, local-completions vs hf: {check['items']} items, max |diff| "
                  f"{check['max_abs_nats']:.2e} nats (doc, choice {tuple(check['worst_item'])}), mean "
                  f"{check['mean_abs_nats']:.2e}; acc {check['acc_served']:.3f} vs {check['acc_reference']:.3f}; "
                  f"is_greedy equal {check['greedy_equal']}/{check['items']} "
                  f"-> {'PASS' if check['ok'] else 'FAIL'} (tolerance {tolerance} nats)")
        else:
            print(f"\nkvs_mc log-likelihoods: no comparison ({check['why']}) -> FAIL")
    else:
        print("\nno verdict: the check needs both the completions and hf runs of kvs_mc")
        ok = False
    same = {f"{a} vs {b}": same_generations(samples(done.get((a, "kvs_gen")), "kvs_gen"),
                                            samples(done.get((b, "kvs_gen")), "kvs_gen"))
            for a, b in (("completions", "hf"), ("chat", "hf-chat")) if (a, "kvs_gen") in done}
    if same:
        summary["kvs_gen_same_generations"] = same
        print("kvs_gen generations equal (not gated): " + ", ".join(f"{k} {v}" for k, v in same.items()))
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"\n{'PASS' if ok else 'FAIL'}; results in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
