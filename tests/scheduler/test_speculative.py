"""Speculative steps through the scheduler and the tier manager, over the fake model.

Greedy outputs with drafts equal those without, whatever the drafts and however many are accepted;
the slots of rejected drafts go back whole (a rejection across a block boundary frees that block);
drafts never preempt and never reach a cache tier; an abort or a preemption in the middle of a
speculative step leaves the pools as if the step never ran.
"""

import functools
import math
import random

import pytest

from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.admission import DecodeReservation
from kvstrata.kvcache.block_pool import BlockState
from kvstrata.scheduler import drafts
from kvstrata.scheduler.drafts import FIRST_PAUSE, JUDGED_AFTER, MAX_BREAK_EVEN, DraftProposer
from tests.kvcache.fakes import (
    HASHER,
    FakeRunner,
    OracleProposer,
    at_rest,
    drive,
    make_request,
    make_scheduler,
    make_tiered_scheduler,
    step,
)

PROMPTS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7] * 11, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]


def speculating(lookahead: int, max_tokens: int = 12, **sampling):
    made = [make_request(f"r{i}", p, max_tokens=max_tokens, **sampling) for i, p in enumerate(PROMPTS)]
    for request in made:
        request.num_lookahead_tokens = lookahead
    return made


def run(scheduler, lookahead: int, runner=None, executor=None, **sampling):
    """Each request's outputs, and the drafts accepted and verified in all, after driving all to the end."""
    runner = runner or FakeRunner(scheduler.tiers.device.num_blocks, scheduler.tiers.block_size)
    made = speculating(lookahead, **sampling)
    outputs = drive(scheduler, runner, executor, made)
    at_rest(scheduler)
    return outputs, sum(r.num_accepted_tokens for r in made), sum(r.num_draft_tokens for r in made)


def random_rejections(seed: int) -> OracleProposer:
    """Drafts rejected at a random position each step, or all accepted."""
    rng = random.Random(seed)
    return OracleProposer(lambda request, k: rng.randint(0, k))


@pytest.mark.parametrize("lookahead", [1, 3, 6])
@pytest.mark.parametrize("sampling", [{}, {"stop_token_ids": (17, 31)}, {"min_tokens": 6, "stop_token_ids": (17,)}])
def test_greedy_outputs_with_drafts_equal_outputs_without(lookahead, sampling):
    reference, _, _ = run(make_scheduler(num_blocks=64), 0, **sampling)
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=24)
    scheduler.proposer = random_rejections(lookahead)
    outputs, accepted, drafted = run(scheduler, lookahead, **sampling)
    assert outputs == reference
    assert 0 < accepted < drafted, "some drafts accepted and some rejected"
    ngram = make_scheduler(num_blocks=64, max_num_batched_tokens=24)
    ngram.proposer = DraftProposer(1, 3)
    assert run(ngram, lookahead, **sampling)[0] == reference


def test_drafts_take_the_budget_waiting_prompts_leave_and_never_pass_max_tokens():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=5)
    scheduler.proposer = OracleProposer(lambda request, k: None)
    runner = FakeRunner(64, 4)
    a, b = speculating(8, max_tokens=9)[:2]
    scheduler.add_request(a)
    step(scheduler, runner)                                   # a's prompt (5 tokens): the whole budget
    scheduler.add_request(b)
    output = step(scheduler, runner)                          # b's prompt (9 tokens) before a's drafts
    assert [(c.request, c.num_tokens, c.draft_token_ids) for c in output.chunks] == [(a, 1, ()), (b, 4, ())]
    drafted = []
    while not a.is_finished:
        before = a.num_output_tokens
        output = step(scheduler, runner)
        chunk = next(c for c in output.chunks if c.request is a)
        assert len(chunk.draft_token_ids) <= a.sampling.max_tokens - before - 1   # the last token is sampled
        drafted.append(len(chunk.draft_token_ids))
    # b's last prompt token (its first four were a's cached block) and a's token leave 3; then 2 of 9
    assert drafted == [3, 2] and a.num_output_tokens == 9


def test_no_drafts_in_a_step_that_computes_a_prompt():
    """Budget to spare, but a prompt chunk in the step: its first token is not delayed by draft rows.
    The next step, decodes only, has them."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    scheduler.proposer = OracleProposer(lambda request, k: None)
    runner = FakeRunner(64, 4)
    a, b = speculating(8, max_tokens=9)[:2]
    scheduler.add_request(a)
    step(scheduler, runner)
    scheduler.add_request(b)
    output = step(scheduler, runner)
    assert [(c.request, c.num_tokens > 1, c.draft_token_ids) for c in output.chunks] == [(a, False, ()), (b, True, ())]
    output = step(scheduler, runner)
    assert all(c.draft_token_ids for c in output.chunks)
    drive(scheduler, runner)
    at_rest(scheduler)


@pytest.mark.parametrize("accepted", range(5))
def test_rejected_drafts_give_back_their_slots_whole(accepted):
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    scheduler.proposer = OracleProposer(lambda request, k: accepted)
    runner = FakeRunner(16, 4)
    request = speculating(4, max_tokens=20)[0]               # 5 prompt tokens
    scheduler.add_request(request)
    step(scheduler, runner)
    free_before = scheduler.tiers.device.num_free
    output = scheduler.schedule()
    assert len(output.chunks[0].draft_token_ids) == 4
    assert len(scheduler.tiers.block_ids("r0")) == 3         # slots 0..9: t at 5, drafts at 6..9
    drafted_block = scheduler.tiers.block_ids("r0")[2]
    scheduler.update(output, runner.execute(output), runner.accepted)
    scheduler.audit()
    assert request.num_computed_tokens == 6 + accepted and request.num_output_tokens == 2 + accepted
    held = math.ceil(request.num_computed_tokens / 4)
    assert len(scheduler.tiers.block_ids("r0")) == held
    assert scheduler.tiers.device.num_free == free_before - (held - 2)
    if held == 2:                                             # the rejection crossed into block 2: it is back
        assert scheduler.tiers.device.blocks[drafted_block].state is BlockState.FREE
    assert len(request.block_hashes) == request.num_tokens // 4      # no hash of a draft that is not in the ledger
    drive(scheduler, runner)
    at_rest(scheduler)


def test_drafts_never_preempt():
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=16,
                               reserve_ratio_init=0.0, reserve_ratio_min=0.0)
    scheduler.proposer = OracleProposer(lambda request, k: None)
    runner = FakeRunner(3, 4)
    a, b = (make_request(rid, [1, 2, 3], max_tokens=8) for rid in "ab")
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)
    a.num_lookahead_tokens = 6                                # 3 + 1 + 6 slots: 2 more blocks, 1 is free
    output = step(scheduler, runner)
    assert scheduler.proposer.proposed["a"] and not output.preempted
    assert [len(c.draft_token_ids) for c in output.chunks] == [0, 0]
    drive(scheduler, runner)
    at_rest(scheduler)


def test_the_reservation_counts_a_step_of_drafts_but_never_more_than_is_left():
    reservation = DecodeReservation(init=0.5, floor=0.5, decay=0.0, clip_tokens=4096)
    request = make_request("r", [1, 2, 3, 4], max_tokens=9)
    request.num_computed_tokens = 4
    request.append_output(5)
    blocks = lambda: reservation.blocks(request, 4, 4, 1)      # blocks of one token: the counts are tokens
    assert blocks() == 1 + 4                                  # pending 1 + 0.5 * 7 left to sample
    request.num_lookahead_tokens = 2
    assert blocks() == 1 + 2 + 4                              # and one step of drafts
    request.num_lookahead_tokens = 30
    assert blocks() == 1 + 7                                  # never more than it may still sample


def test_drafts_never_reach_a_cache_tier():
    """Write-through with host and store: every block ever indexed or stored holds tokens of a real output."""
    reference, _, _ = run(make_scheduler(num_blocks=64), 0)
    scheduler, runner, executor, _, store = make_tiered_scheduler(num_blocks=24, num_host_blocks=8,
                                                                  write_policy="write_through")
    scheduler.proposer = random_rejections(7)
    outputs, accepted, drafted = run(scheduler, 4, runner, executor)
    assert outputs == reference and 0 < accepted < drafted
    real = set()
    for prompt, output in zip(PROMPTS, reference.values()):
        hashes = []
        HASHER.extend(hashes, prompt + output)
        real.update(hashes)
    stored = set(store.records) | {b.block_hash for pool in (scheduler.tiers.device, scheduler.tiers.host)
                                   for b in pool.blocks if b.block_hash is not None}
    assert stored and stored <= real


def twin(lookahead: int = 4):
    """One request after its prefill, with drafts rejected from the second on each step."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    scheduler.proposer = OracleProposer(lambda request, k: 1)
    runner = FakeRunner(16, 4)
    request = speculating(lookahead, max_tokens=20)[0]
    scheduler.add_request(request)
    step(scheduler, runner)
    return scheduler, runner


@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_an_abort_or_preemption_mid_speculation_leaves_the_pools_as_if_the_step_never_ran(end):
    def end_now(scheduler):
        if end == "abort":
            scheduler.finish("r0")
        else:
            assert scheduler.preempt("r0")

    plain, _ = twin()
    end_now(plain)
    speculated, runner = twin()
    output = speculated.schedule()
    assert output.chunks[0].draft_token_ids
    end_now(speculated)
    speculated.update(output, runner.execute(output), runner.accepted)
    speculated.audit()
    assert speculated.tiers.snapshot(with_order=False) == plain.tiers.snapshot(with_order=False)
    if end == "preempt":                                     # it resumes and ends as it would have
        assert speculated.requests["r0"].status is RequestStatus.PREEMPTED
        drive(speculated, runner)
    at_rest(speculated)


def test_drafts_that_do_not_pay_pause_and_probe_again_later():
    """n-gram drafts accepted less often than the break-even pause once JUDGED_AFTER verifications are
    in, for FIRST_PAUSE output tokens, then again for twice that; drafts that are accepted go on; a
    prediction always goes on; outputs stay those of plain decoding."""
    reference, _, _ = run(make_scheduler(num_blocks=64), 0, max_tokens=48)
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=24)
    scheduler.proposer = OracleProposer(lambda request, k: 0 if request.request_id != "r1" else None)
    made = speculating(4, max_tokens=48)
    made[2].prediction_token_ids = (1, 2, 3)          # wrong drafts too, but the client asked
    verified: dict[str, list[int]] = {r.request_id: [] for r in made}   # output tokens at each verification
    judged = drafts.judge

    def record(request, drafted, accepted, break_even):
        verified[request.request_id].append(request.num_output_tokens)
        judged(request, drafted, accepted, break_even)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvstrata.scheduler.scheduler.judge", record)
        outputs = drive(scheduler, FakeRunner(64, 4), requests=made)
    at_rest(scheduler)
    assert outputs == reference
    for request in (made[0], made[3]):           # one token per rejection, from its first step without a prompt
        first = verified[request.request_id][0]      # chunk in it (others' prompts filled the budget before)
        again = first - 1 + JUDGED_AFTER + FIRST_PAUSE   # paused at its last judged verification
        assert verified[request.request_id] == [*range(first, first + JUDGED_AFTER),
                                                *range(again, again + JUDGED_AFTER)]
        assert request.draft_history.paused_until == again + JUDGED_AFTER - 1 + 2 * FIRST_PAUSE
        assert request.num_accepted_tokens == 0
    assert made[1].draft_history.paused_until == 0 and made[1].num_accepted_tokens == made[1].num_draft_tokens > 0
    assert made[2].draft_history.paused_until == 0 and verified["r2"] == list(range(verified["r2"][0], 47)) and made[2].num_accepted_tokens == 0


@pytest.mark.parametrize("break_even, drafting", [(0.0, True), (MAX_BREAK_EVEN + 0.01, False)])
def test_the_engines_break_even_decides_whether_drafts_pay(break_even, drafting):
    """At a break-even of 0 a draft always pays (never paused, however often rejected); above
    MAX_BREAK_EVEN (a large batch) no step drafts at all, but a request with a prediction still does
    (the client sent it)."""
    reference, _, _ = run(make_scheduler(num_blocks=64), 0, max_tokens=40)
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=24)
    scheduler.proposer = OracleProposer(lambda request, k: 0)
    scheduler.schedule = functools.partial(scheduler.schedule, break_even=lambda decodes: break_even)
    made = speculating(4, max_tokens=40)
    made[3].prediction_token_ids = (1, 2, 3)
    outputs = drive(scheduler, FakeRunner(64, 4), requests=made)
    at_rest(scheduler)
    assert outputs == reference
    for request in made:
        assert request.draft_history.paused_until == 0 and request.num_accepted_tokens == 0
        if drafting or request.prediction_token_ids:
            assert request.num_draft_tokens > 3 * 36
        else:
            assert request.num_draft_tokens == 0