"""An adapter's files read from a path nobody vouches for (kvstrata/model/adapters/files.py): sizes judged
before a byte is read, a weights file exactly its header's declared length, nothing read beyond it, and
under --lora-root nothing that resolves outside, whatever symlink leads there."""

import json
import os
import shutil
import struct
import threading

import pytest
import torch

from kvstrata.model.adapters import files
from kvstrata.model.adapters.lora import AdapterError, load_adapter, max_adapter_bytes

GIB = 2**30


@pytest.fixture
def read_bytes(monkeypatch):
    """Counts every byte the reader takes from a file."""
    count = [0]
    real = os.preadv

    def counting(fd, buffers, offset):
        got = real(fd, buffers, offset)
        count[0] += got
        return got
    monkeypatch.setattr(files.os, "preadv", counting)
    return count


def _load(smollm2, folder, roots=(), max_rank=64):
    return load_adapter("x", folder, smollm2.arch, torch.float32, smollm2.device, max_rank, roots)


def _copy(lora_adapters, tmp_path, name="copy"):
    return shutil.copytree(lora_adapters["alpha"], tmp_path / name)


def _header(weights):
    """(header dict, data bytes) of a safetensors file."""
    raw = weights.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write(weights, header, data):
    head = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(head)) + head + data)


def test_a_sparse_gigabyte_weights_file_is_refused_by_its_size_unread(smollm2, lora_adapters, tmp_path, read_bytes):
    folder = _copy(lora_adapters, tmp_path)
    with open(folder / files.WEIGHTS_FILE, "r+b") as f:
        f.truncate(GIB)                                   # sparse: a gigabyte of holes
    assert max_adapter_bytes(smollm2.arch, 64) < GIB       # SmolLM2 at rank 64: ~156 MB at the widest dtype
    with pytest.raises(AdapterError, match="over the"):
        _load(smollm2, folder)
    assert read_bytes[0] == (folder / files.CONFIG_FILE).stat().st_size     # the config, not a byte of weights


def test_a_config_over_its_cap_is_refused_unread(smollm2, lora_adapters, tmp_path, read_bytes):
    folder = _copy(lora_adapters, tmp_path)
    with open(folder / files.CONFIG_FILE, "r+b") as f:
        f.truncate(files.MAX_CONFIG_BYTES + 1)
    with pytest.raises(AdapterError, match="adapter_config.json is 1048577 bytes"):
        _load(smollm2, folder)
    assert read_bytes[0] == 0


@pytest.mark.parametrize("how, words", [
    ("padded", "its header declares"),          # bytes past the declared data
    ("gap", "do not tile"),                    # a hole between two tensors
    ("overlap", "do not tile"),
    ("huge_header", "declares a header of"),
    ("dtype", "dtype other than"),
    ("shape", "does not fit this model"),      # a declared shape no target of this model has
    ("no_offsets", "data_offsets"),
    ("not_json", "no valid safetensors header"),
    ("layer_digits", "cannot apply"),           # a layer number Python's int() refuses to parse
])
def test_a_weights_file_whose_header_lies_is_refused(smollm2, lora_adapters, tmp_path, how, words, read_bytes):
    folder = _copy(lora_adapters, tmp_path)
    weights = folder / files.WEIGHTS_FILE
    header, data = _header(weights)
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
    if how == "padded":
        data += b"\0" * 64
    elif how == "gap":
        header[second]["data_offsets"] = [o + 4 for o in header[second]["data_offsets"]]
    elif how == "overlap":
        header[second]["data_offsets"][0] -= 4
    elif how == "dtype":
        header[first]["dtype"] = "I64"
    elif how == "shape":
        header[first]["shape"] = header[first]["shape"][::-1]       # as many bytes, the wrong way round
    elif how == "no_offsets":
        del header[first]["data_offsets"]
    elif how == "layer_digits":
        header[first.replace("layers.0.", "layers." + "9" * 5000 + ".", 1)] = header.pop(first)
    if how == "huge_header":
        weights.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    elif how == "not_json":
        weights.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    else:
        _write(weights, header, data)
    with pytest.raises(AdapterError, match=words):
        _load(smollm2, folder)
    assert read_bytes[0] < 2**20 < len(data)          # the config and the header at most, never the ~10 MB of data


@pytest.mark.parametrize("config", ['[' * 100_000, '"just a string"', '{"r": 8, "lora_alpha": "16"}',
                                    '{"r": 8, "peft_type": "PROMPT_TUNING"}', b"\xff\xfe{}"])
def test_a_config_that_is_not_a_lora_config_is_refused(smollm2, lora_adapters, tmp_path, config):
    folder = _copy(lora_adapters, tmp_path)
    (folder / files.CONFIG_FILE).write_bytes(config if isinstance(config, bytes) else config.encode())
    with pytest.raises(AdapterError) as refused:
        _load(smollm2, folder)
    assert "PROMPT_TUNING" not in str(refused.value)         # the files' contents never reach a message


def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(smollm2, lora_adapters, tmp_path):
    folder = _copy(lora_adapters, tmp_path)
    (folder / files.WEIGHTS_FILE).unlink()
    os.mkfifo(folder / files.WEIGHTS_FILE)                # opened blocking, a FIFO waits for a writer forever
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(AdapterError, _load, smollm2, folder)),
                              daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert done and "not a regular file" in str(done[0].value)


@pytest.mark.parametrize("path", ["x" * 5000, "/tmp/a\0b", "\ud800", ""])
def test_a_path_the_os_cannot_take_is_refused_before_any_system_call(smollm2, path):
    with pytest.raises(AdapterError, match="path"):
        _load(smollm2, path)


def test_under_roots_nothing_resolving_outside_is_opened(smollm2, lora_adapters, tmp_path):
    root, outside = tmp_path / "root", _copy(lora_adapters, tmp_path, "outside")
    inside = _copy(lora_adapters, root, "inside")
    (root / "escape").symlink_to(outside)                                     # a folder link leading out
    (root / "mixed").mkdir()
    (root / "mixed" / files.CONFIG_FILE).symlink_to(inside / files.CONFIG_FILE)   # a file link that stays in
    (root / "mixed" / files.WEIGHTS_FILE).symlink_to(outside / files.WEIGHTS_FILE)  # and one that leads out
    (root / "alias").symlink_to(inside)                                       # a link that stays in
    roots = (str(root),)
    assert _load(smollm2, root / "alias", roots).digest == _load(smollm2, inside, roots).digest
    for refused in (outside, root / "escape", root / "mixed", root / "inside" / ".." / ".." / "outside"):
        with pytest.raises(AdapterError, match="outside every --lora-root"):
            _load(smollm2, refused, roots)
    assert _load(smollm2, outside).digest                # trusted (no roots): read where it is


def test_a_link_swapped_in_after_the_check_leads_nowhere(smollm2, lora_adapters, tmp_path, monkeypatch):
    """The race a realpath check alone loses: a folder swapped for a link between the check and the open."""
    root, outside = tmp_path / "root", _copy(lora_adapters, tmp_path, "outside")
    inside = _copy(lora_adapters, root / "sub", "adapter")
    realpath = os.path.realpath

    def then_swap(path):                 # the check sees the real folder; then `sub` becomes a link out
        resolved = realpath(path)
        if str(path).endswith(files.CONFIG_FILE) and (root / "sub").is_dir() and not (root / "sub").is_symlink():
            os.rename(root / "sub", tmp_path / "moved")
            (root / "sub").symlink_to(outside.parent)
            (tmp_path / "adapter").symlink_to(outside)
        return resolved
    monkeypatch.setattr(files.os.path, "realpath", then_swap)
    with pytest.raises(AdapterError, match="cannot open adapter_config.json"):
        _load(smollm2, inside, (str(root),))
