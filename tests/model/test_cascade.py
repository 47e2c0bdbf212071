"""Cascade (shared-prefix) attention equals plain paged attention.

Model level, on a tiny random Llama: twin caches with the same history decode the same sequences,
one with `DecodeGroup`s and one without, decodes read in place by the paged kernel or gathered; logits agree within fp32 tolerance (and with
transformers), greedy tokens are identical. Then the runner's grouping (`group_decodes`) on exact
block tables, and the engine on SmolLM2: greedy outputs with prefix caching on (groups form) equal
those with caching off (no block is shared, so no group can form)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig

from kvstrata.core.config import ModelConfig
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.kvcache.prefix_groups import group_cost_tokens, group_decodes
from kvstrata.model.loader import load_model
from kvstrata.model.network.decoder import DecoderModel
from kvstrata.model.network.forward_batch import DecodeGroup
from tests.model.model_helpers import Seq, new_cache, run_step, save_tiny_hf_model

ATOL = 1e-4          # float32 logits of magnitude ~10
VOCAB = 256
BLOCK = 4
NUM_BLOCKS = 400


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """(folder, the transformers model): a random Llama with GQA, 4 query heads over 2 kv heads."""
    folder = tmp_path_factory.mktemp("cascade")
    hf = save_tiny_hf_model(folder, LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    return folder, hf


@pytest.fixture(scope="module", params=["in-place", "gathered"])
def tiny(tiny_folder, request):
    """(our LoadedModel in float32, the transformers model); its decodes read their own blocks in
    place (the paged kernel, kvstrata.model.kernels) or gathered (the torch path)."""
    folder, hf = tiny_folder
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32", device="cpu"))
    assert loaded.model.attn.reads_in_place(BLOCK, torch.float32, torch.device("cpu")), \
        "the paged kernel did not build (see kvstrata.model.kernels)"
    if request.param == "gathered":       # the same weights, assembled without the kernel
        loaded.model = DecoderModel(loaded.model.parts, dataclasses.replace(loaded.model.kernels, paged=None))
    return loaded, hf


class Blocks:
    """Block ids drawn from a shuffled pool (block 0 is the tables' padding), so nothing is contiguous."""

    def __init__(self, seed: int) -> None:
        self.free = list(range(1, NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]


@dataclass
class Family:
    seqs: list[Seq]
    shared: int                    # leading block ids all of them hold


def family(size: int, prefix_len: int, steps: int, blocks: Blocks, rng: random.Random) -> Family:
    """`size` prompts starting with the same `prefix_len` tokens. As prefix caching leaves them, the
    prefix's full blocks are one set of ids held by all; the rest of each prompt (1-6 tokens of its
    own) and its `steps` decoded tokens get blocks of their own."""
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    shared = blocks.take(prefix_len // BLOCK)
    seqs = []
    for _ in range(size):
        tokens = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        total = -(-(len(tokens) + steps) // BLOCK)
        seqs.append(Seq(tokens, shared + blocks.take(total - len(shared))))
    return Family(seqs, len(shared))


def loner(length: int, steps: int, blocks: Blocks, rng: random.Random) -> Seq:
    return Seq([rng.randrange(VOCAB) for _ in range(length)], blocks.take(-(-(length + steps) // BLOCK)))


def prefill(model, kv, families: list[Family], others: list[Seq]) -> None:
    """The first of each family computes its whole prompt; the others start after the shared blocks."""
    for fam in families:
        run_step(model, kv, [(fam.seqs[0], len(fam.seqs[0].tokens))])
        for seq in fam.seqs[1:]:
            seq.computed = fam.shared * BLOCK
            run_step(model, kv, [(seq, len(seq.tokens) - seq.computed)])
    for seq in others:
        run_step(model, kv, [(seq, len(seq.tokens))])


def groups_of(families: list[Family]) -> list[DecodeGroup]:
    groups, row = [], 0
    for fam in families:
        groups.append(DecodeGroup(row, row + len(fam.seqs), fam.shared))
        row += len(fam.seqs)
    return groups


def decode_twins(loaded, families: list[Family], others: list[Seq], steps: int,
                 chunks: list[tuple[Seq, list[int]]] = (), atol: float = ATOL) -> list[Seq]:
    """Prefill, copy the cache, then `steps` greedy steps on each twin: the families' decodes
    grouped on one and plain on the other, `others` decoding ungrouped, and each (seq, sizes) of
    `chunks` computing sizes[step] more prompt tokens (none when 0). Asserts equal logits and
    equal tokens at every step; returns the grouped twin's sequences."""
    kv = new_cache(loaded, NUM_BLOCKS, BLOCK)
    prefill(loaded.model, kv, families, others)
    twin_kv = new_cache(loaded, NUM_BLOCKS, BLOCK)
    twin_kv.data.copy_(kv.data)
    plain = (families, others, list(chunks), kv, [])
    grouped = (*copy.deepcopy((families, others, list(chunks))), twin_kv, groups_of(families))
    for step in range(steps):
        logits = []
        for fams, loners, pieces, cache, groups in (plain, grouped):
            decodes = [s for fam in fams for s in fam.seqs] + loners
            for seq in decodes:
                seq.tokens.append(int(seq.logits[-1].argmax()))      # greedy, on this twin's own logits
            work = [(s, 1) for s in decodes] + [(s, sizes[step]) for s, sizes in pieces
                                                 if step < len(sizes) and sizes[step]]
            logits.append(run_step(loaded.model, cache, work, groups))
        torch.testing.assert_close(logits[1], logits[0], atol=atol, rtol=0)
        assert [s.tokens for s in decodes] == [s.tokens for fam in families for s in fam.seqs] + \
            [s.tokens for s in others]
    fams, loners, pieces = grouped[:3]
    return [s for fam in fams for s in fam.seqs] + loners + [s for s, _ in pieces]


def assert_matches_transformers(seq: Seq, hf) -> None:
    """Our logits for the tokens this Seq computed equal transformers' on its whole token list."""
    with torch.no_grad():
        ref = hf(torch.tensor([seq.tokens[:seq.computed]])).logits[0]
    ours = torch.stack(seq.logits)
    torch.testing.assert_close(ours, ref[seq.computed - len(ours):], atol=ATOL, rtol=0)


@pytest.mark.parametrize("prefix_len", [10, 12], ids=["prefix-ends-mid-block", "prefix-ends-on-boundary"])
@pytest.mark.parametrize("size", [1, 2, 16])
def test_cascade_equals_plain_attention(tiny, size, prefix_len):
    loaded, hf = tiny
    rng = random.Random(size * 100 + prefix_len)
    seqs = family(size, prefix_len, steps=7, blocks=Blocks(size), rng=rng)
    for seq in decode_twins(loaded, [seqs], [], steps=7):             # crosses block edges on the way
        assert_matches_transformers(seq, hf)


def test_mixed_batch_of_groups_loners_and_prefill_chunks(tiny):
    """Two groups (one prefix ends mid-block, one on a boundary), two ungrouped decodes, a prompt
    prefilled in chunks and a fresh prompt arriving later, together in every forward."""
    loaded, hf = tiny
    rng, blocks = random.Random(7), Blocks(7)
    families = [family(3, 13, 6, blocks, rng), family(2, 16, 6, blocks, rng)]
    others = [loner(30, 6, blocks, rng), loner(5, 6, blocks, rng)]
    chunked, fresh = loner(23, 0, blocks, rng), loner(9, 0, blocks, rng)
    done = decode_twins(loaded, families, others, steps=6, chunks=[(chunked, [5, 4, 9, 5]), (fresh, [0, 0, 9])])
    assert chunked.computed == 23 and fresh.computed == 9
    for seq in done:
        assert_matches_transformers(seq, hf)


def test_cascade_in_bfloat16_stays_close_to_plain(tiny_folder):
    """bfloat16 K/V and queries, float32 scores and log-sum-exp: within bfloat16 rounding."""
    loaded = load_model(ModelConfig(model=str(tiny_folder[0]), dtype="bfloat16", device="cpu"))
    rng, blocks = random.Random(11), Blocks(11)
    families = [family(4, 14, 4, blocks, rng), family(3, 8, 4, blocks, rng)]
    decode_twins(loaded, families, [loner(19, 4, blocks, rng)], steps=4, atol=0.1)


@pytest.mark.parametrize("exact", [True, False])
def test_float64_attention_gives_every_path_the_same_bits(tiny_folder, exact):
    """`compute_dtype=float64` (what int8 models use): grouped and plain decodes, and a chunk after
    a cached prefix against a one-piece prefill, give bit-identical float32 logits. Plain float32
    attention is shown to differ on the same work, so the test can tell the two apart."""
    loaded = load_model(ModelConfig(model=str(tiny_folder[0]), dtype="float32", device="cpu"))
    loaded.model = DecoderModel(dataclasses.replace(loaded.model.parts, exact_attention=exact), loaded.model.kernels)
    rng, blocks = random.Random(5), Blocks(5)
    kv = new_cache(loaded, NUM_BLOCKS, BLOCK)
    tokens = [rng.randrange(VOCAB) for _ in range(90)]
    whole, split = Seq(tokens, blocks.take(23)), Seq(list(tokens), blocks.take(23))
    run_step(loaded.model, kv, [(whole, 90)])
    run_step(loaded.model, kv, [(split, 36)])                        # as if a cache hit had left 36
    run_step(loaded.model, kv, [(split, 54)])
    same_prefill = torch.equal(torch.stack(whole.logits[36:]), torch.stack(split.logits[36:]))
    families = [family(4, 14, 4, blocks, rng), family(3, 8, 4, blocks, rng)]
    try:
        decode_twins(loaded, families, [loner(19, 4, blocks, rng)], steps=4, atol=0)
        same_decodes = True
    except AssertionError:
        same_decodes = False
    assert (same_prefill and same_decodes) if exact else not (same_prefill and same_decodes)


def test_group_decodes_picks_the_groups_that_save_most():
    """The module docstring's example: block size 4, every decode at 18 tokens (4 shareable blocks)."""
    tables = [[7, 8, 9, 1, 11], [7, 8, 9, 2, 12], [7, 8, 9, 4, 13], [7, 5, 6, 3, 14], [7, 5, 6, 10, 15]]
    lens = [18] * 5
    # {a, b, c} and {d, e} share 3 blocks each: 2 * 12 + 1 * 12 tokens saved, against 4 * 4 for all five
    assert group_decodes(tables, lens, 4, group_cost_tokens=0) == \
        ([3, 4, 0, 1, 2], [DecodeGroup(0, 2, 3), DecodeGroup(2, 5, 3)])
    # at a cost of 20 tokens per group only {a, b, c} pays; the others keep their order behind it
    assert group_decodes(tables, lens, 4, group_cost_tokens=20) == ([0, 1, 2, 3, 4], [DecodeGroup(0, 3, 3)])
    assert group_decodes(tables, lens, 4, group_cost_tokens=100) == ([0, 1, 2, 3, 4], [])


def test_in_place_groups_only_where_they_pay():
    """With the kernel reading blocks in place a group must save far more (IN_PLACE_GROUP_COST_TOKENS):
    4 decodes sharing 512 tokens are grouped when blocks are gathered, not in place; 16 sharing
    1,024 are grouped either way."""
    def shared(k: int, blocks: int) -> tuple[list[list[int]], list[int]]:
        return [list(range(blocks)) + [1000 + i] for i in range(k)], [blocks * 16 + 1] * k
    assert group_decodes(*shared(4, 32), 16, group_cost_tokens(in_place=False))[1] == [DecodeGroup(0, 4, 32)]
    assert group_decodes(*shared(4, 32), 16, group_cost_tokens(in_place=True))[1] == []
    assert group_decodes(*shared(16, 64), 16, group_cost_tokens(in_place=True))[1] == [DecodeGroup(0, 16, 64)]


def test_group_decodes_never_shares_the_block_a_decode_writes():
    # 8 tokens in 2 blocks: the token written now is in block 2, so only block 1 may be shared
    assert group_decodes([[1, 2], [1, 2]], [8, 8], 4, group_cost_tokens=0) == ([0, 1], [DecodeGroup(0, 2, 1)])
    assert group_decodes([[1, 2], [1, 2]], [5, 5], 4, group_cost_tokens=0) == ([0, 1], [DecodeGroup(0, 2, 1)])
    assert group_decodes([[1], [1]], [4, 4], 4, group_cost_tokens=0) == ([0, 1], [])
    assert group_decodes([[3, 1], [4, 1], [5, 1]], [8, 8, 8], 4, group_cost_tokens=0) == ([0, 1, 2], [])
    assert group_decodes([], [], 4) == ([], [])


BACKGROUND = ("Background: the Loire rises in the Massif Central and flows north, then west, past Orleans, "
              "Tours, Angers and Nantes to the Atlantic at Saint-Nazaire. ") * 6
QUESTIONS = ["Question: how long is the river?", "Question: name a city on it.", "Question: where does it end?",
             "Question: where does it rise?", "Question: which way does it flow?", "Q: say hello."]


@pytest.mark.parametrize("weights", ["float32", "gguf"])
@pytest.mark.parametrize("options", [dict(), dict(block_size=8, max_num_batched_tokens=64)],
                         ids=["default", "small-blocks-chunked"])
def test_engine_greedy_outputs_identical_with_shared_prefixes(make_engine, default_model, monkeypatch, options, weights):
    """Caching on: the warm-up puts the background in the cache, the six requests then hold its
    blocks and decode in groups (formed whatever they save: a prefix this short would not pay on
    its own). Caching off: no block is shared, so no group forms. Same tokens. For float32 weights
    and for the default model at its GGUF's bits (int8 activation blocks: a last bit that differs
    between paths becomes another quant, which is why its attention sums by the row alone)."""
    if weights == "gguf":
        make_engine = functools.partial(make_engine, loaded=default_model)
    import kvstrata.worker.runner as runner_module

    formed: list[DecodeGroup] = []
    costs: set[int] = set()

    def spy(tables, seq_lens, block_size, cost):
        costs.add(cost)
        order, groups = group_decodes(tables, seq_lens, block_size, group_cost_tokens=0)
        formed.extend(groups)
        return order, groups

    monkeypatch.setattr(runner_module, "group_decodes", spy)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [BACKGROUND + q for q in QUESTIONS]
    cached = make_engine(**options)
    cached.generate([BACKGROUND + "Question: what is this about?"], greedy)
    on = cached.generate(prompts, greedy)
    assert max(g.end - g.start for g in formed) == len(prompts)      # all six decoded as one group
    formed.clear()
    off = make_engine(enable_prefix_caching=False, **options).generate(prompts, greedy)
    assert not formed
    assert [o.new_token_ids for o in on] == [o.new_token_ids for o in off]
    assert all(o.num_cached_tokens > 0 for o in on)
    assert costs == {group_cost_tokens(cached.runner.decodes_in_place)}     # what the runner asks for
