"""The servers the benchmarks start and stop: kvstrata, vLLM's CPU build and llama.cpp's llama-server.

Each runs in its own process with THREADS torch/OpenMP threads, and answers the OpenAI API on
127.0.0.1:PORT. At a real shape (`--load-format dummy --model llama-3.2-1b`) all three serve the same
config: kvstrata its dummy weights, vLLM its own (`--load-format dummy`, the folder
peers/dummy_model_dir.py writes), llama-server a GGUF of kvstrata's dummy weights (peers/dummy_gguf.py,
written once per shape and type into the peers' cache). Peers are never kvstrata dependencies: they
live in benchmarks/peers/venvs and build/ (git-ignored).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "benchmarks" / "peers"
BIN = Path(sys.executable).parent
THREADS = 2
PEER_CACHE = Path(os.environ.get("PEER_CACHE", "/tmp/kvstrata-peers-cache"))

logger = logging.getLogger("servers")


def peer_env() -> dict[str, str]:
    cache = str(PEER_CACHE)
    return {"OMP_NUM_THREADS": str(THREADS), "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "VLLM_CACHE_ROOT": f"{cache}/vllm", "HF_HOME": f"{cache}/hf", "XDG_CACHE_HOME": f"{cache}/xdg",
            "MPLCONFIGDIR": f"{cache}/mpl", "HF_HUB_OFFLINE": "1"}


@dataclass
class Server:
    label: str
    port: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)          # beside peer_env()
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log: Path) -> None:
        logger.info("starting %s: %s", self.label, " ".join(self.command))
        with open(log, "a") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                            env={**os.environ, **peer_env(), **self.env})

    def wait_ready(self, timeout: float = 900) -> float:
        """Seconds until /v1/models answers 200 (llama-server answers 503 while it loads)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.label} exited with {self.process.returncode} while starting")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return round(time.monotonic() - start, 1)
            time.sleep(1)
        raise RuntimeError(f"{self.label} not ready after {timeout}s")

    def stop(self, timeout: float = 120) -> None:
        """SIGTERM and wait (kvstrata writes its cache to the store on the way out), then SIGKILL."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def kvstrata(label: str, port: int, *flags: str, shape: str | None = None, model: str | None = None) -> Server:
    """`kvstrata serve` on the default model, on `shape`'s dummy weights, or on `model` (a name or a file)."""
    model = ("--load-format", "dummy", "--model", shape) if shape else ("--model", model) if model else ()
    return Server(label, port, [str(BIN / "kvstrata"), "serve", *model, "--threads", str(THREADS),
                                "--port", str(port), *flags])


def vllm(label: str, port: int, *flags: str, shape: str | None = None, kv_bytes: int = 4 * 1024**3,
         max_model_len: int | None = None) -> Server:
    """vLLM's CPU build on the default model's HF folder, or on `shape` with its own dummy weights; `kv_bytes`
    of KV cache, allocated at start-up (`--kv-cache-memory-bytes`, through serve_vllm.sh's KV_BYTES). vLLM
    refuses to start unless one request of `max_model_len` tokens fits that cache."""
    env = {"KV_BYTES": str(kv_bytes)}
    if shape:
        folder = subprocess.run([sys.executable, str(PEERS / "dummy_model_dir.py"), "--model", shape], check=True,
                                stdout=subprocess.PIPE, text=True).stdout.strip()
        context = max_model_len or os.environ.get("VLLM_MAX_MODEL_LEN", "16384")
        env.update(MODEL_DIR=folder, NAME=shape, MAX_MODEL_LEN=str(context))
        flags = ("--load-format", "dummy", *flags)
    return Server(label, port, [str(PEERS / "serve_vllm.sh"), str(port), "--enable-prompt-tokens-details", *flags],
                  env)


def llama_server(label: str, port: int, *flags: str, shape: str | None = None, gguf_type: str = "q8_0",
                 ctx: int = 16384, gguf: Path | None = None) -> Server:
    """llama-server as its users start it (`-np 16 -kvu`, its prompt caches at their defaults) on the default
    model's Q4_1 GGUF, on a GGUF of `shape`'s dummy weights in `gguf_type`, or on the file `gguf`; `ctx` tokens
    of KV."""
    env = {"CTX": str(ctx)}
    if shape:
        env.update(GGUF=str(dummy_gguf(shape, gguf_type)), ALIAS=shape)
    elif gguf is not None:
        env.update(GGUF=str(gguf), ALIAS=gguf.stem)
    return Server(label, port, [str(PEERS / "serve_llama_server.sh"), str(port), *flags], env)


def dummy_gguf(shape: str, gguf_type: str) -> Path:
    """The GGUF of `shape`'s dummy weights in `gguf_type` (bf16, q8_0, q4_0), written once into the peers' cache."""
    path = PEER_CACHE / "gguf" / f"{shape}-seed0.{gguf_type}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(PEERS / "dummy_gguf.py"), "--model", shape, "--type", gguf_type,
                        "--out", str(path)], check=True)
    return path


def install_peers(log_dir: Path, names: tuple[str, ...] = ("vllm", "llama_server"),
                  env: dict[str, str] | None = None) -> None:
    """Install (once) the peers named: install_<name>.sh in benchmarks/peers, `env` beside ours."""
    for name in names:
        with open(log_dir / f"install-{name}.log", "w") as out:
            subprocess.run([str(PEERS / f"install_{name}.sh")], stdout=out, stderr=subprocess.STDOUT, check=True,
                           timeout=3600, env={**os.environ, **(env or {})})
