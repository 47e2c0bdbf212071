"""LoRA adapters: greedy parity with transformers + PEFT (fp32, token for token, adapters and the base
mixed in one batch), PEFT folders that cannot be served (refused with a message, nothing kept), and
how a step's rows are grouped by adapter."""

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstrata.core.config import EngineConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.model.adapters.lora import AdapterError, group_rows, load_adapter
from tests.model.model_helpers import kernels_on

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,",
    "The three primary colors are", "To make a cup of tea, first", "import numpy as np\n",
    "The best way to learn a language is", "Water boils at", "Dear hiring manager,",
    "The mitochondria is", "SELECT name FROM users WHERE", "In 1969, the first person to walk on the moon",
    "A haiku about paging:\n", "The quick brown fox", "Photosynthesis converts", "My favourite book is",
    "Rivers flow into", "The square root of 144 is", "Here is a list of fruits: apple,", "Tomorrow I will",
]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lora_engine(smollm2_fp32, lora_adapters):
    modules = tuple(f"{name}={path}" for name, path in lora_adapters.items())
    return LLMEngine(EngineConfig.from_options(kv_cache_memory="64MiB", audit_every_step=True, lora_modules=modules,
                                               max_loras=4), loaded=smollm2_fp32)


def _peft_greedy(smollm2, folder, prompts):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, folder).eval()
    out = []
    for prompt in prompts:
        ids = smollm2.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(tokens[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("prompts", [pytest.param(6, id="6-prompts"),
                                     pytest.param(len(PROMPTS), id="all-prompts", marks=pytest.mark.slow)])
def test_greedy_outputs_equal_peft_for_three_adapters_batched_with_the_base(smollm2_fp32, lora_adapters, lora_engine,
                                                                             prompts):
    """PEFT's greedy decoding is one generate call per prompt and adapter, ~0.7 s each here: 6 prompts in the main
    suite, every prompt in the slow one."""
    names, chosen = ["alpha", "beta", "gamma"], PROMPTS[:prompts]
    # every prompt under every adapter and the base, interleaved, in one generate call: one batch mixes them
    work = [(name, prompt) for prompt in chosen for name in (*names, None)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = lora_engine.generate([p for _, p in work], params, lora=[n for n, _ in work])
    ours = {(name, prompt): out.new_token_ids for (name, prompt), out in zip(work, outputs)}
    differs = 0
    for name in names:            # the base model's own parity with transformers: tests/model/test_model.py
        reference = _peft_greedy(smollm2_fp32, lora_adapters[name], chosen)
        for prompt, expected in zip(chosen, reference):
            assert ours[(name, prompt)] == expected, (name, prompt)
            differs += expected != ours[(None, prompt)]
    assert differs >= 3 * len(chosen) // 2, \
        f"only {differs} of {3 * len(chosen)} adapter outputs differ from the base model's: adapters too weak"


def test_an_adapter_is_fused_into_the_decoders_projections(smollm2, lora_adapters):
    arch = smollm2.arch
    beta = load_adapter("beta", lora_adapters["beta"], arch, torch.float32, smollm2.device, 64)
    assert beta.rank == 16 and len(beta.layers) == arch.num_layers
    assert set(beta.layers[0]) == {"qkv", "o"}           # attention only
    qkv = beta.layers[0]["qkv"]
    assert qkv.a.shape == (48, arch.hidden_size) and qkv.bt.shape == (48, arch.q_size + 2 * arch.kv_size)
    assert not qkv.bt[16:, :arch.q_size].any()           # block-diagonal: q's outputs read only q's A
    gamma = load_adapter("gamma", lora_adapters["gamma"], arch, torch.float32, smollm2.device, 64)
    assert set(gamma.layers[3]) == {"gate_up", "down"}
    assert beta.digest == _digest(lora_adapters["beta"]) != gamma.digest


def _digest(folder):
    """The digest's format, fixed: the stores and routers key adapters' blocks by it across versions."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        data = (folder / name).read_bytes()
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def _broken(tmp_path, folder, how):
    """A copy of `folder` broken one way; returns its path."""
    bad = tmp_path / how
    shutil.copytree(folder, bad)
    weights, config = bad / "adapter_model.safetensors", bad / "adapter_config.json"
    if how == "no_weights":
        weights.unlink()
    elif how == "bad_json":
        config.write_text("{not json")
    elif how == "dora":
        config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        tensors = load_file(weights)
        key = next(k for k in tensors if "q_proj.lora_B" in k)
        if how == "bad_shape":
            tensors[key] = tensors[key][:-3]
        elif how == "embedding":
            tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(8, 576)
        elif how == "missing_b":
            del tensors[key]
        save_file(tensors, weights)
    return bad


BROKEN = {"no_weights": "cannot open adapter_model.safetensors", "bad_json": "not valid JSON", "dora": "use_dora",
          "truncated": "declares a header", "bad_shape": "does not fit", "embedding": "cannot apply",
          "missing_b": "lora_B missing"}


@pytest.mark.parametrize("how", sorted(BROKEN))
def test_an_adapter_that_cannot_be_served_is_refused_and_nothing_is_kept(lora_engine, lora_adapters, tmp_path, how):
    adapters = lora_engine.adapters
    before = (dict(adapters.registered), dict(adapters.resident), dict(adapters.users))
    with pytest.raises(AdapterError, match=BROKEN[how]):
        adapters.register("broken", _broken(tmp_path, lora_adapters["alpha"], how))
    assert (dict(adapters.registered), dict(adapters.resident), dict(adapters.users)) == before
    lora_engine.scheduler.audit()
    adapters.audit()


def test_over_rank_and_missing_folders_are_refused(smollm2, lora_adapters, tmp_path):
    with pytest.raises(AdapterError, match="rank 16, over --max-lora-rank 8"):
        load_adapter("beta", lora_adapters["beta"], smollm2.arch, torch.float32, smollm2.device, 8)
    with pytest.raises(AdapterError, match="cannot open adapter_config.json"):
        load_adapter("x", tmp_path / "nothing", smollm2.arch, torch.float32, smollm2.device, 64)


def test_rows_are_grouped_by_adapter_as_slices_where_contiguous(smollm2, lora_adapters):
    a, b = (load_adapter(n, lora_adapters[n], smollm2.arch, torch.float32, smollm2.device, 64) for n in ("alpha", "gamma"))
    assert group_rows([None, None], [1, 5], smollm2.device) is None
    batch = group_rows([a, a, None, b, a], [1, 1, 1, 4, 2], smollm2.device)
    groups = {g.weights.name: g.rows for g in batch.groups}
    assert groups["gamma"] == slice(3, 7)
    assert groups["alpha"].tolist() == [0, 1, 7, 8]
    x, y = torch.randn(9, smollm2.arch.hidden_size), torch.zeros(9, 2 * smollm2.arch.intermediate_size)
    batch.apply(0, "gate_up", x, y)
    assert not y[2].any() and y[3].any() and y[0].any()     # the base row is untouched
    pair = a.layers[0]["gate_up"]
    torch.testing.assert_close(y[7], (x[7] @ pair.a.T) @ pair.bt)


@kernels_on
def test_bf16_rows_all_go_to_the_kernel_prefill_chunks_too(smollm2, lora_adapters):
    """Every row of a bf16 step under an adapter the kernel takes is the kernel's, a long prefill run too: a row's
    bits then never depend on the chunk it came in (torch's matmuls round by the run's length)."""
    a = load_adapter("alpha", lora_adapters["alpha"], smollm2.arch, torch.bfloat16, smollm2.device, 64)
    long = 130
    batch = group_rows([a, None, a, a, None, a], [1, 1, 1, long, 1, 2], smollm2.device)
    assert batch.groups == () and batch.kernel.rows.tolist() == [0, *range(2, 3 + long), 4 + long, 5 + long]
    x = torch.randn(6 + long, smollm2.arch.hidden_size).bfloat16()
    y0 = torch.zeros(6 + long, smollm2.arch.q_size + 2 * smollm2.arch.kv_size).bfloat16()
    y = batch.apply(0, "qkv", x, y0.clone())
    reference = group_rows([a, None, a, a, None, a], [1, 1, 1, long, 1, 2], smollm2.device, use_kernel=False)
    torch.testing.assert_close(y, reference.apply(0, "qkv", x, y0.clone()), atol=0.05, rtol=0.05)
    assert not y[1].any() and not y[3 + long].any() and y[0].any() and y[2].any()
    chunks = [group_rows([a], [n], smollm2.device).apply(0, "qkv", x[lo:lo + n], y0[lo:lo + n].clone())
              for lo, n in ((2, 17), (19, long - 16))]                 # the same run in two chunks: the same bits
    assert torch.equal(torch.cat(chunks), y[2:3 + long])


@kernels_on
def test_the_bf16_kernel_adds_each_groups_update_and_a_rows_bits_never_depend_on_its_batch(smollm2, lora_adapters):
    arch, device = smollm2.arch, smollm2.device
    a, g = (load_adapter(n, lora_adapters[n], arch, torch.bfloat16, device, 64) for n in ("alpha", "gamma"))
    assert a.kernel_takes and g.kernel_takes
    adapters, lengths = [a, None, g, a, g, a], [1, 1, 1, 3, 2, 1]      # alpha's rows 0, 3-5, 8: not contiguous
    gen = torch.Generator().manual_seed(0)
    for layer, name in ((0, "qkv"), (5, "o"), (11, "gate_up"), (29, "down"), (2, "qkv")):
        pair = a.layers[layer][name]
        width_in, width_out = pair.a.shape[1], pair.bt.shape[1]
        x = torch.randn(9, width_in + 16, generator=gen).bfloat16()[:, 8:8 + width_in]     # a row stride > width
        y0 = torch.randn(9, width_out, generator=gen).bfloat16()
        fused = group_rows(adapters, lengths, device)
        assert fused.kernel is not None
        y = fused.apply(layer, name, x, y0.clone())
        expected = y0.float().clone()
        for weights, rows in ((a, [0, 3, 4, 5, 8]), (g, [2, 6, 7])):
            p = weights.layers[layer].get(name)
            if p is not None:
                expected[rows] += (x[rows].float() @ p.a.float().T) @ p.bt.float()
        torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)
        assert torch.equal(y[1], y0[1])                                     # the base row is untouched
        torch.testing.assert_close(y, group_rows(adapters, lengths, device, use_kernel=False).apply(
            layer, name, x, y0.clone()), atol=0.1, rtol=0.05)               # torch rounds its two matmuls too
        alone = group_rows([a], [1], device).apply(layer, name, x[8:9], y0[8:9].clone())
        assert torch.equal(alone[0], y[8]), "a row's bits changed with its batch"
