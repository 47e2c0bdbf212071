"""`kvstrata serve` as a user runs it: ready when it says so, vLLM's positional MODEL, --log-level
after the command, a line at shutdown, limits checked at start, and help that reads well."""

import argparse
import signal
import subprocess
import sys

import httpx
import pytest

from kvstrata.entrypoints.cli.main import build_parser
from kvstrata.entrypoints.flags import engine_config
from kvstrata.model.loader import default_model_path
from tests.entrypoints.server_helpers import MODEL, free_port


def serve(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvstrata", "serve", *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_ready_line_means_the_socket_accepts_and_shutdown_is_logged():
    port = free_port()
    proc = serve(str(default_model_path()), "--port", str(port), "--kv-cache-memory", "64MiB",
                 "--log-level", "INFO")
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        assert f"serving {MODEL} on http://127.0.0.1:{port}" in lines[-1], "".join(lines)
        # No retry: the line is printed once the port accepts.
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"] == MODEL
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0
        assert "shutting down" in rest and "stopped:" in rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_context_longer_than_the_model_is_refused_at_start():
    out = subprocess.run([sys.executable, "-m", "kvstrata", "serve", "--max-model-len", "9000",
                          "--kv-cache-memory", "64MiB"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "longer than the model's context (8192" in out.stderr


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_help_shows_each_default_once_in_human_units():
    text = _subparser(build_parser(), "serve").format_help()
    assert "(default: 1GiB)" in text and "(default: 20GiB)" in text and "1073741824" not in text
    for action in _subparser(build_parser(), "serve")._actions:
        assert (action.help or "").count("default") <= 1, action.help


def test_every_bench_serve_flag_has_help():
    for action in _subparser(build_parser(), "bench", "serve")._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_store_path_means_the_disk_store(tmp_path):
    parser = build_parser()
    config = engine_config(parser.parse_args(["serve", "--store-path", str(tmp_path)]))
    assert config.cache.store == "disk" and config.cache.store_path == str(tmp_path)
    with pytest.raises(ValueError, match="store_path names a disk store folder"):
        engine_config(parser.parse_args(["serve", "--store", "redis://127.0.0.1:1/0", "--store-path", "x"]))
