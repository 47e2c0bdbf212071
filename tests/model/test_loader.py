"""Loading: the default model's location, GGUF conversion (names, llama.cpp's q/k permutation,
tied embeddings, the cache), HF folders (configs, tokenizer, EOS ids), fingerprints."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, PreTrainedTokenizerFast

from kvstrata.core.config import ModelConfig
from kvstrata.model.arch import describe as arch_from_hf_config
from kvstrata.model.loader import default_model_path, file_sha256, load_model, resolve_device
from kvstrata.model.sources import gguf_convert
from tests.model.model_helpers import Seq, new_cache, run_step, save_tiny_hf_model, write_tiny_gguf

TINY = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def tiny_gguf(tmp_path):
    hf = save_tiny_hf_model(tmp_path / "hf", TINY, seed=7)
    path = tmp_path / "Tiny-Llama.Q8_0.gguf"
    write_tiny_gguf(path, hf)
    return path, hf


def test_gguf_conversion_undoes_llama_cpp_permutation_and_ties_embeddings(tiny_gguf):
    path, hf = tiny_gguf
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu"))
    assert loaded.name == "Tiny-Llama"
    assert loaded.arch.tie_word_embeddings
    assert loaded.tokenizer is None and loaded.chat_template is None
    seq = Seq(list(range(3, 40)), blocks=[9, 4, 0, 6, 2, 7, 1, 8, 3, 5])
    kv = new_cache(loaded, 10, 4)
    run_step(loaded.model, kv, [(seq, 30)])
    for _ in range(7):
        run_step(loaded.model, kv, [(seq, 1)])
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens])).logits[0]
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=1e-4, rtol=0)


def test_a_gguf_with_llama3_rope_freqs_matches_transformers(tmp_path):
    """Llama 3 GGUFs carry their RoPE scaling as a factor per frequency (rope_freqs.weight)."""
    config = LlamaConfig(**{**TINY.to_dict(), "max_position_embeddings": 256, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    hf = save_tiny_hf_model(tmp_path / "hf", config, seed=5)
    path = tmp_path / "Tiny-Llama3.gguf"
    write_tiny_gguf(path, hf)
    loaded = load_model(ModelConfig(model=str(path), dtype="float32", device="cpu"))
    assert loaded.arch.rope_scaling["rope_type"] == "freq_factors"
    seq = Seq(list(range(3, 100)), blocks=list(range(7)))
    kv = new_cache(loaded, 7, 16)
    run_step(loaded.model, kv, [(seq, 97)])
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens])).logits[0]
    torch.testing.assert_close(torch.stack(seq.logits), ref, atol=1e-4, rtol=0)


def test_gguf_is_converted_once_then_loaded_from_the_cache(tiny_gguf, monkeypatch):
    path, _ = tiny_gguf
    first = load_model(ModelConfig(model=str(path), device="cpu"))

    def fail(*args):
        raise AssertionError("converted twice")
    monkeypatch.setattr(gguf_convert, "_convert", fail)
    second = load_model(ModelConfig(model=str(path), device="cpu"))
    assert second.fingerprint == first.fingerprint


def test_concurrent_conversions_end_with_one_complete_folder(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    root = tmp_path / "race"
    sha = file_sha256(path)
    results, errors = [], []

    def convert():
        try:
            results.append(gguf_convert.ensure_converted(path, root, sha))
        except Exception as e:  # noqa: BLE001  (surfaced by the assert below)
            errors.append(e)
    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    folder = results[0]
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "kvstrata.json", "gguf-blocks"}
    assert [p.name for p in (root / "models").iterdir()] == [folder.name]   # no temp folders left


def test_fingerprint_is_stable_and_follows_the_weights(tmp_path):
    folder = tmp_path / "m"
    save_tiny_hf_model(folder, TINY, seed=1)
    a = load_model(ModelConfig(model=str(folder), device="cpu")).fingerprint
    assert load_model(ModelConfig(model=str(folder), device="cpu")).fingerprint == a
    other = tmp_path / "other"
    save_tiny_hf_model(other, TINY, seed=2)                 # same shapes, other values
    assert load_model(ModelConfig(model=str(other), device="cpu")).fingerprint != a


def test_the_kv_cache_format_is_named_in_the_fingerprint(monkeypatch):
    """A bf16 and a float32 engine of the same weights never share a key, even where nothing else in their
    fingerprints differs (no kernel of ours, no exact attention): a record of the other format is a miss."""
    from kvstrata.model import fingerprint
    from kvstrata.model.formats.dense import DenseFormat

    arch = arch_from_hf_config(TINY.to_dict())
    kernels = SimpleNamespace(norm_act=None, paged=None)
    found = {dtype: fingerprint.identity([("w", "1")], arch, DenseFormat(), kernels, False, False, dtype,
                                         torch.device("cpu"))
             for dtype in (torch.bfloat16, torch.float32)}
    assert found[torch.bfloat16]["kv_cache_dtype"] == "bfloat16"
    assert fingerprint.digest(found[torch.bfloat16]) != fingerprint.digest(found[torch.float32])
    assert {k: v for k, v in found[torch.bfloat16].items() if k != "kv_cache_dtype"} == \
        {k: v for k, v in found[torch.float32].items() if k != "kv_cache_dtype"}


def test_folder_tokenizer_chat_template_and_eos_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(126)} | {"<eos>": 126, "<eot>": 127}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", chat_template=template)
    folder = tmp_path / "m"
    save_tiny_hf_model(folder, TINY, tokenizer=tokenizer)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [127, 126]}))
    loaded = load_model(ModelConfig(model=str(folder), device="cpu"))
    assert loaded.chat_template == template
    assert loaded.eos_token_ids[:2] == (127, 126)
    assert loaded.tokenizer("w5 w7")["input_ids"] == [5, 7]


def test_arch_reads_both_config_styles():
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    v4 = arch_from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "linear", "factor": 2.0}})
    v5 = arch_from_hf_config({**base, "rope_parameters": {
        "rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}})
    assert v4 == v5 and v4.rope_theta == 5e5
    assert v4.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = arch_from_hf_config({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 16
    qwen = arch_from_hf_config({**base, "model_type": "qwen2"})
    assert qwen.attention_bias and not qwen.attention_out_bias


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_arch_rejects_what_it_cannot_run(change, message):
    config = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**config, **change})


def test_bad_model_paths_are_user_errors(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        load_model(ModelConfig(model=str(tmp_path / "missing.gguf")))
    with pytest.raises(ValueError, match="config.json"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_default_model_is_found_without_importing_its_package():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="make install"):
        default_model_path()


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("tpu")


@pytest.mark.slow
def test_smollm2_tensors_match_transformers_own_gguf_loader(monkeypatch):
    """The independent check of the permutation and name map on the real file (~25 s)."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    monkeypatch.delenv("KVSTRATA_CACHE_DIR")         # reuse the conversion of the default cache
    from safetensors.torch import load_file

    from kvstrata.core.config import cache_dir

    path = default_model_path()
    folder = gguf_convert.ensure_converted(path, cache_dir(), file_sha256(path))
    ours = load_file(folder / "model.safetensors")
    config = LlamaConfig(**load_gguf_checkpoint(str(path))["config"])
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


def test_sharded_folder_reads_only_the_indexed_shards(tmp_path):
    hf = save_tiny_hf_model(tmp_path / "single", TINY, seed=3)
    folder = tmp_path / "sharded"
    hf.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    (folder / "consolidated.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    sharded = load_model(ModelConfig(model=str(folder), device="cpu"))
    single = load_model(ModelConfig(model=str(tmp_path / "single"), device="cpu"))
    seq_a, seq_b = Seq(list(range(20)), [0, 1, 2, 3, 4]), Seq(list(range(20)), [0, 1, 2, 3, 4])
    for loaded, seq in ((sharded, seq_a), (single, seq_b)):
        run_step(loaded.model, new_cache(loaded, 5, 4), [(seq, 20)])
    assert torch.equal(torch.stack(seq_a.logits), torch.stack(seq_b.logits))


def test_first_conversion_shows_a_progress_bar_on_a_terminal(tiny_gguf, tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    path, _ = tiny_gguf
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    gguf_convert.ensure_converted(path, tmp_path / "bar", file_sha256(path))
    assert f"converting {path.name}" in screen.getvalue()
    assert re.search(r"(\d+)/\1 ", screen.getvalue()), "the bar never reached its total"
