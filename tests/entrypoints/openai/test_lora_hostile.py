"""/v1/load_lora_adapter against a client probing the server's file system: every path it cannot serve
is the same 400 with the same body (nothing tells a missing path from a file, a folder outside
--lora-root, a malformed adapter or a path the OS cannot take), never a 500; without
--allow-runtime-lora-updating (or vLLM's variable) neither route exists, whatever the body; and the
files are read off the engine thread, which goes on serving meanwhile."""

import json
import os
import shutil
import threading

import httpx
import pytest

from kvstrata.engine import adapters as engine_adapters
from tests.entrypoints.server_helpers import MODEL, blocks_at_rest, running_server, wait_idle

REFUSED = {"error": {"message": "cannot load a LoRA adapter from this path", "type": "invalid_request_error",
                     "param": "lora_path", "code": None}}


@pytest.fixture(scope="module")
def root(lora_adapters, tmp_path_factory):
    """--lora-root: one good adapter and every kind of bad one; beside it, a good adapter outside."""
    base = tmp_path_factory.mktemp("hostile")
    root, outside = base / "root", shutil.copytree(lora_adapters["gamma"], base / "outside")
    shutil.copytree(lora_adapters["alpha"], root / "good")
    (root / "file.txt").write_text("not a folder")
    (root / "empty").mkdir()
    for name, config in (("bad_json", "{not json"), ("prompt_tuning", '{"peft_type": "PROMPT_TUNING", "r": 8}'),
                         ("deep", "[" * 100_000)):
        shutil.copytree(lora_adapters["alpha"], root / name)
        (root / name / "adapter_config.json").write_text(config)
    shutil.copytree(lora_adapters["alpha"], root / "sparse")
    with open(root / "sparse" / "adapter_model.safetensors", "r+b") as f:
        f.truncate(2**30)                                 # a sparse gigabyte, refused by its size
    (root / "escape").symlink_to(outside)
    (root / "loop").symlink_to(root / "loop")
    return root


@pytest.fixture(scope="module")
def server(smollm2, root):
    with running_server(smollm2, num_device_blocks=96, block_size=16, enable_lora=True,
                        allow_runtime_lora_updating=True, lora_root=(str(root),)) as (base, engine):
        yield base, engine


def _load(base, path, name="probe"):
    """POST a load; the body's JSON escapes what UTF-8 cannot carry (a lone surrogate: \\ud800)."""
    return httpx.post(f"{base}/v1/load_lora_adapter", content=json.dumps({"lora_name": name, "lora_path": path}),
                      headers={"content-type": "application/json"}, timeout=60)


HOSTILE = ["/nowhere/at/all", "{root}/missing", "{root}/file.txt", "{root}/empty", "{root}/bad_json",
           "{root}/prompt_tuning", "{root}/deep", "{root}/sparse", "{root}/escape", "{root}/loop",
           "{root}/good/../../outside", "{outside}", "/etc", "/etc/passwd", "/dev/zero", "/proc/self",
           "relative/path", "..", "x" * 5000, "/" + "a/" * 3000, "{root}/good\u0000", "{root}/good/adapter_config.json"]


@pytest.mark.parametrize("path", HOSTILE, ids=range(len(HOSTILE)))
def test_every_refused_path_is_the_same_400(server, root, path):
    base, engine = server
    path = path.format(root=root, outside=root.parent / "outside")
    reply = _load(base, path)
    assert (reply.status_code, reply.json()) == (400, REFUSED), reply.text
    assert "probe" not in engine.adapters.registered and not engine.adapters.reading


@pytest.mark.parametrize("path", ["\ud800", "{root}/good\udcff"])
def test_a_path_that_is_not_text_is_refused_by_validation_before_the_file_system(server, root, path):
    reply = _load(server[0], path.format(root=root))
    assert reply.status_code == 400 and "valid string" in reply.json()["error"]["message"]


def test_a_good_adapter_beneath_the_root_loads_and_serves(server, root):
    base, engine = server
    assert _load(base, str(root / "good"), "good").status_code == 200
    reply = httpx.post(f"{base}/v1/completions", json={"model": "good", "prompt": "Hello", "max_tokens": 3},
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "good"
    wait_idle(engine)
    assert blocks_at_rest(base)["used"] == 0


def test_loading_reads_off_the_engine_thread_which_keeps_serving(server, root, monkeypatch):
    """The reader is held until a completion has run to its end: a load that blocked the engine thread
    would deadlock here (and time out)."""
    base, _ = server
    readers, release = [], threading.Event()
    real = engine_adapters.load_adapter

    def held(*args):
        readers.append(threading.current_thread().name)
        assert release.wait(timeout=60), "never released"
        return real(*args)
    monkeypatch.setattr(engine_adapters, "load_adapter", held)
    loading = threading.Thread(target=lambda: readers.append(_load(base, str(root / "good"), "held").status_code))
    loading.start()
    while not readers:
        threading.Event().wait(0.01)
    served = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4,
                                                          "ignore_eos": True}, timeout=30)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
    release.set()
    loading.join(timeout=60)
    assert readers[0] != "kvstrata-engine" and readers[1] == 200


@pytest.mark.parametrize("env", [None, "0", "false", "yes"])
def test_without_the_flag_both_routes_are_404_whatever_the_body(smollm2, lora_adapters, monkeypatch, env):
    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    with running_server(smollm2, lora_modules=(f"alpha={lora_adapters['alpha']}",)) as (base, engine):
        bodies = [json.dumps({"lora_name": "x", "lora_path": str(lora_adapters["beta"])}),
                  json.dumps({"lora_name": "alpha"}), "{not json", "", "x" * 10_000]
        replies = {(route, body): httpx.post(f"{base}/v1/{route}_lora_adapter", content=body,
                                             headers={"content-type": "application/json"})
                   for route in ("load", "unload") for body in bodies}
        assert {(r.status_code, r.text) for r in replies.values()} == {(404, replies[("load", bodies[0])].text)}
        assert set(engine.adapters.registered) == {"alpha"}


@pytest.mark.parametrize("env", ["1", "true", "True", " TRUE "])
def test_vllms_variable_allows_it_as_the_flag_does(smollm2, lora_adapters, monkeypatch, env):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    with running_server(smollm2, enable_lora=True) as (base, engine):
        assert _load(base, str(lora_adapters["beta"]), "beta").status_code == 200     # no --lora-root: anywhere
        for path in ("/nowhere", "/etc", "/etc/passwd", "/dev/zero", str(lora_adapters["beta"].parent)):
            reply = _load(base, path)
            assert (reply.status_code, reply.json()) == (400, REFUSED)                # yet no way to tell them apart
        assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "beta"}).status_code == 200
        assert not engine.adapters.registered


def test_the_flag_without_enable_lora_is_refused_at_start():
    from kvstrata.core.config import EngineConfig

    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineConfig.from_options(allow_runtime_lora_updating=True)
    with pytest.raises(ValueError, match="is not a folder"):
        EngineConfig.from_options(enable_lora=True, lora_root=(os.devnull,))
