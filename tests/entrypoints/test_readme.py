"""The README's quick-start examples, run as written (against a test server's port)."""

import contextlib
import io
import re
import subprocess
from pathlib import Path

import pytest

from tests.entrypoints.server_helpers import running_server

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def example(name: str) -> str:
    match = re.search(rf"<!-- example: {name} -->\n```\w+\n(.*?)```", README, re.S)
    assert match, f"README lost its {name} example"
    return match.group(1)


@pytest.fixture(scope="module")
def base(default_model):
    with running_server(default_model) as (url, _):
        yield url


def test_readme_opens_with_the_two_setup_commands():
    head = README.splitlines()[:8]
    assert any(line.startswith("make serve") for line in head) and any(line.startswith("make test") for line in head)


def test_curl_example(base):
    command = example("curl").replace("http://127.0.0.1:8000", base)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True, timeout=120)
    assert "Paris" in out.stdout


def test_openai_streaming_example(base):
    code = example("openai").replace("http://127.0.0.1:8000", base)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README:openai", "exec"), {})
    assert "Paris" in printed.getvalue()


def test_llm_api_example():
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(example("llm"), "README:llm", "exec"), {})
    assert "Paris" in printed.getvalue()
