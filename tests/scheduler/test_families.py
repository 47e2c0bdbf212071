"""Families of samples (n / best_of > 1) in the scheduler and the tier manager, with the fake model.

The fake runner checks every KV position a step reads, so a sample whose copy of the leader's last
prompt block were wrong (or shared while written) fails its first decode.
"""

import pytest

from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.block_pool import BlockState
from kvstrata.kvcache.faults import FaultInjector, FaultyMover
from tests.kvcache.fakes import (
    PREFIX,
    FakeMover,
    FakeRunner,
    drain,
    drive,
    evict_everything,
    make_family,
    make_request,
    make_scheduler,
    make_tiered_scheduler,
    reference_outputs,
    step,
)

PROMPT = list(range(1, 11))        # 10 tokens: two full blocks of 4, and 2 tokens in the third


def family_scheduler(num_blocks=32, **options):
    runner = FakeRunner(num_blocks, 4)
    return make_scheduler(num_blocks=num_blocks, mover=FakeMover(runner, 0), **options), runner


def prompt_tokens_computed(outputs) -> int:
    return sum(max(0, min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start)
               for output in outputs for c in output.chunks)


def test_a_family_prefills_once_shares_full_blocks_and_copies_the_last():
    scheduler, runner = family_scheduler()
    leader = make_family("f", PROMPT, n=3, max_tokens=6)
    scheduler.add_request(leader)
    samples = leader.family.samples
    assert [s.status for s in samples[1:]] == [RequestStatus.AWAITING_FORK] * 2
    outputs = [step(scheduler, runner)]
    assert outputs[0].chunks[0].forks == tuple(samples[1:])
    tables = [scheduler.tiers.block_ids(s.request_id) for s in samples]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]          # full prompt blocks: shared
    assert len({t[2] for t in tables}) == 3                         # the last one: a copy each
    device = scheduler.tiers.device
    assert [device.blocks[b].ref_cnt for b in tables[0][:2]] == [3, 3]
    assert all(s.num_computed_tokens == len(PROMPT) for s in samples)
    while scheduler.has_unfinished:
        outputs.append(step(scheduler, runner))                     # the runner checks every KV read
    assert prompt_tokens_computed(outputs) == len(PROMPT)
    assert len({tuple(s.output_token_ids) for s in samples}) == 3   # each sample its own first token
    assert all(s.num_output_tokens == 6 for s in samples)
    counts = scheduler.tiers.audit()["device"]
    assert counts.used == 0 and counts.in_flight == 0 and counts.free + counts.cached == 32


def test_a_prompt_that_fills_its_blocks_forks_without_a_copy():
    scheduler, runner = family_scheduler()
    leader = make_family("f", PROMPT[:8], n=2, max_tokens=3)
    scheduler.add_request(leader)
    free_before = scheduler.tiers.device.num_available
    step(scheduler, runner)
    assert free_before - scheduler.tiers.device.num_available == 2  # two shared blocks, nothing copied
    assert scheduler.tiers.block_ids("f/0") == scheduler.tiers.block_ids("f/1")
    drain(scheduler, runner)


def test_admission_of_a_family_is_refused_whole_and_takes_nothing():
    # 10 blocks: the leader alone needs 3 (+1 to grow); the family of 4 needs 3 + 3 * 2 = 9 at ratio 1.
    scheduler, runner = family_scheduler(num_blocks=10, reserve_ratio_init=1.0, reserve_ratio_min=1.0)
    blocker = make_request("blocker", [40, 41, 42, 43, 44], max_tokens=4)
    scheduler.add_request(blocker)
    step(scheduler, runner)
    leader = make_family("f", PROMPT, n=4, max_tokens=4)
    scheduler.add_request(leader)
    before = scheduler.tiers.snapshot()
    assert scheduler.tiers.plan(leader, 64) is None
    plan_alone_fits = scheduler.tiers.plan(make_request("alone", PROMPT, max_tokens=4), 64) is not None
    assert plan_alone_fits                                         # the leader alone would fit: the family does not
    output = scheduler.schedule()
    assert [c.request for c in output.chunks] == [blocker]
    scheduler.update(output, runner.execute(output))
    assert all(s.status in (RequestStatus.WAITING, RequestStatus.AWAITING_FORK) for s in leader.family.samples)
    assert not any(scheduler.tiers.holds(s.request_id) or scheduler.tiers.has_fork(s.request_id)
                   for s in leader.family.samples)
    assert scheduler.tiers.snapshot()[2] == before[2]              # no block table was added
    drain(scheduler, runner)                                       # once the blocker is done, the family runs
    assert all(s.num_output_tokens == 4 for s in leader.family.samples)


def test_a_family_counts_against_max_num_seqs_whole():
    scheduler, runner = family_scheduler(max_num_seqs=3)
    scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=8))
    step(scheduler, runner)
    leader = make_family("f", PROMPT, n=3)
    scheduler.add_request(leader)
    step(scheduler, runner)
    assert leader.status is RequestStatus.WAITING                  # 1 + 3 seats > 3
    with pytest.raises(ValueError, match="lower n"):
        scheduler.add_request(make_family("g", PROMPT, n=4))
    drain(scheduler, runner)


def test_a_family_that_can_never_fit_is_refused_at_add():
    scheduler, _ = family_scheduler(num_blocks=8)
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_family("f", PROMPT, n=4, max_tokens=6))   # 4 + 3 * 2 = 10 > 8
    assert not scheduler.requests


def test_preempting_the_leader_before_the_fork_gives_back_every_place():
    scheduler, runner = family_scheduler(max_num_batched_tokens=4)     # prefill in chunks of 4
    leader = make_family("f", PROMPT, n=3, max_tokens=3)
    scheduler.add_request(leader)
    step(scheduler, runner)
    assert scheduler.tiers.has_fork("f/1") and scheduler.tiers.has_fork("f/2")
    assert scheduler.preempt("f/0")
    assert not scheduler.tiers.has_fork("f/1") and scheduler.tiers.device.counts().used == 0
    scheduler.audit()
    drain(scheduler, runner)
    assert all(s.num_output_tokens == 3 for s in leader.family.samples)


def test_aborting_the_leader_before_the_fork_ends_the_family():
    scheduler, runner = family_scheduler(max_num_batched_tokens=4)
    leader = make_family("f", PROMPT, n=3)
    scheduler.add_request(leader)
    step(scheduler, runner)
    scheduler.finish("f/0")
    assert all(s.status is RequestStatus.FINISHED_ABORTED for s in leader.family.samples)
    assert not scheduler.requests
    counts = scheduler.tiers.audit()["device"]
    assert counts.used == 0


def test_preempting_a_forked_sample_preempts_its_family_and_they_rehit_the_prompt():
    scheduler, runner = family_scheduler()
    leader = make_family("f", PROMPT, n=3, max_tokens=6)
    scheduler.add_request(leader)
    step(scheduler, runner)
    shared = scheduler.tiers.block_ids("f/0")[:2]
    assert scheduler.preempt("f/1")
    assert all(s.status is RequestStatus.PREEMPTED for s in leader.family.samples)
    assert all(scheduler.tiers.device.blocks[b].state is BlockState.CACHED for b in shared)
    step(scheduler, runner)
    assert all(s.num_cached_tokens == 0 for s in leader.family.samples)   # first admission's count stays
    assert scheduler.tiers.block_ids("f/0")[:2] == scheduler.tiers.block_ids("f/2")[:2] == shared
    drain(scheduler, runner)
    assert all(s.num_output_tokens == 6 for s in leader.family.samples)


def test_a_failed_copy_costs_the_sample_a_recompute_of_the_last_block():
    runner = FakeRunner(32, 4)
    faults = FaultInjector()
    scheduler = make_scheduler(num_blocks=32, mover=FaultyMover(FakeMover(runner, 0), faults))
    faults.arm("copy")
    leader = make_family("f", PROMPT, n=2, max_tokens=4)
    scheduler.add_request(leader)
    outputs = [step(scheduler, runner)]
    assert leader.family.samples[1].num_computed_tokens == 8        # the 2 tokens past the full blocks: again
    while scheduler.has_unfinished:
        outputs.append(step(scheduler, runner))
    assert prompt_tokens_computed(outputs) == len(PROMPT) + 2
    assert scheduler.tiers.stats.faults == {"copy": 1}
    assert scheduler.tiers.audit()["device"].used == 0


@pytest.mark.parametrize("tier", ["host", "store"])
def test_a_family_whose_prompt_is_in_a_lower_tier_loads_once_then_forks(tier):
    scheduler, runner, executor, _, _ = make_tiered_scheduler(num_blocks=16, num_host_blocks=16 if tier == "host"
                                                              else 2, store=tier == "store")
    drive(scheduler, runner, executor, [make_request("a", PREFIX + [99], max_tokens=2)])
    evict_everything(scheduler, runner, executor, "fill")
    if tier == "store":
        evict_everything(scheduler, runner, executor, "more")
    leader = make_family("f", PREFIX + [98, 97], n=3, max_tokens=5)
    drive(scheduler, runner, executor, [leader])                       # the runner checks every KV read
    samples = leader.family.samples
    assert leader.num_cached_tokens == 16 and scheduler.tiers.stats.hit_tokens[tier] > 0
    assert leader.output_token_ids == list(reference_outputs([PREFIX + [98, 97]]).values())[0]
    assert all(s.num_output_tokens == 5 for s in samples) and leader.family.forked
    counts = scheduler.tiers.audit()["device"]
    assert counts.used == 0 and counts.in_flight == 0
