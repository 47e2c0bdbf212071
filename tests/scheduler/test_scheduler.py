"""Scheduler behaviour with the fake runner; every step is audited (see fakes.step)."""

import random

import pytest

from kvstrata.core.request import RequestStatus
from kvstrata.kvcache.block_pool import BlockState
from tests.kvcache.fakes import EOS, FakeRunner, drive, make_request, make_scheduler, step


def runner_for(scheduler):
    return FakeRunner(scheduler.tiers.device.num_blocks, scheduler.tiers.block_size)


def test_chunked_prefill_splits_a_long_prompt_by_the_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    r = runner_for(s)
    s.add_request(make_request("a", list(range(20)), max_tokens=2))
    sizes = [[c.num_tokens for c in step(s, r).chunks] for _ in range(4)]
    assert sizes == [[8], [8], [4], [1]]
    assert not s.has_unfinished


def test_running_requests_come_first_and_share_the_budget():
    s = make_scheduler(max_num_batched_tokens=10)
    r = runner_for(s)
    s.add_request(make_request("a", list(range(6)), max_tokens=5))
    step(s, r)                                        # a: 6 prefill tokens
    s.add_request(make_request("b", list(range(100, 120)), max_tokens=2))
    out = step(s, r)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]


def test_a_prefill_limit_cuts_prefill_beside_decodes_and_never_a_decode():
    """The engine's step-time target: with decodes running, prompts (continued or newly admitted)
    share what the limit allows; the decodes all run; without decodes the limit is not asked."""
    s = make_scheduler(max_num_batched_tokens=16)
    r = runner_for(s)
    asked = []

    def limit(decodes, waiting):
        asked.append((decodes, waiting))
        return 3

    s.add_request(make_request("a", list(range(6)), max_tokens=5))
    s.add_request(make_request("b", list(range(10, 16)), max_tokens=5))
    assert [c.num_tokens for c in step(s, r, limit).chunks] == [6, 6] and asked == []
    s.add_request(make_request("c", list(range(100, 120)), max_tokens=2))
    s.add_request(make_request("d", list(range(200, 210)), max_tokens=2))
    out = step(s, r, limit)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 3)]
    assert asked == [(2, 2)]                                 # a, b decode; c, d wait
    out = step(s, r, lambda decodes, waiting: 5)             # c continues within the limit, d gets the rest
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 5)]
    out = step(s, r, lambda decodes, waiting: 14)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 12),
                                                                          ("d", 2)]


def test_the_prefill_limit_counts_only_waiting_requests_that_have_a_seat():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    r = runner_for(s)
    asked = []
    for name, base in (("a", 0), ("b", 10)):
        s.add_request(make_request(name, list(range(base, base + 6)), max_tokens=5))
    step(s, r)
    for name, base in (("c", 100), ("d", 200), ("e", 300)):
        s.add_request(make_request(name, list(range(base, base + 20)), max_tokens=2))
    step(s, r, lambda decodes, waiting: asked.append((decodes, waiting)) or 3)
    assert asked == [(2, 1)]                          # one seat left: c may start, d and e wait for seats


def test_outputs_are_identical_with_and_without_a_prefill_limit():
    results = []
    for limit in (None, lambda decodes, waiting: 2,
                  lambda decodes, waiting: 7 - min(decodes, 6) + min(waiting, 3)):
        s = make_scheduler(num_blocks=24, max_num_batched_tokens=12, max_model_len=40)
        r = runner_for(s)
        requests = shared_prefix_requests(20)
        for request in requests:
            s.add_request(request)
        for _ in range(2000):
            if not s.has_unfinished:
                break
            step(s, r, limit)
        assert not s.has_unfinished
        results.append({q.request_id: q.output_token_ids for q in requests})
    assert results[0] == results[1] == results[2]


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    r = runner_for(s)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [i] * 3, max_tokens=3))
    out = step(s, r)
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"] and s.num_waiting == 1


def test_without_chunked_prefill_a_prompt_runs_whole():
    s = make_scheduler(max_num_batched_tokens=64, chunked=False)
    r = runner_for(s)
    s.add_request(make_request("a", list(range(40)), max_tokens=2))
    s.add_request(make_request("b", list(range(100, 140)), max_tokens=2))
    out = step(s, r)
    assert [c.num_tokens for c in out.chunks] == [40]       # b does not fit whole in the rest


def test_preemption_takes_the_latest_arrival_and_it_resumes_first_with_a_cache_hit():
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=32, reserve_ratio_init=0.0, reserve_ratio_min=0.0)
    r = runner_for(s)
    a = make_request("a", list(range(8)), max_tokens=16, arrival=0.0)
    b = make_request("b", list(range(50, 58)), max_tokens=16, arrival=1.0)
    s.add_request(a)
    s.add_request(b)
    step(s, r)                                        # both prefilled: 2 blocks each, 4 free
    preempted = []
    while not preempted:
        preempted = step(s, r).preempted
    assert preempted == ["b"] and b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    cached = [blk for blk in s.tiers.device.blocks if blk.state is BlockState.CACHED]
    assert len(cached) >= 2                           # b's full blocks stay cached
    s.add_request(make_request("c", list(range(90, 94)), max_tokens=2, arrival=2.0))
    assert [q.request_id for q in s.waiting_requests()] == ["b", "c"]   # resumed before new
    while not b.status is RequestStatus.RUNNING:
        step(s, r)
    assert b.num_computed_tokens > 0 or b.is_finished
    drive(s, r)


def test_priority_policy_preempts_the_lowest_priority():
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=32, policy="priority",
                       reserve_ratio_init=0.0, reserve_ratio_min=0.0)
    r = runner_for(s)
    low = make_request("low", list(range(8)), max_tokens=16, priority=5, arrival=0.0)
    high = make_request("high", list(range(50, 58)), max_tokens=16, priority=0, arrival=1.0)
    s.add_request(low)
    s.add_request(high)
    preempted = []
    while not preempted:
        preempted = step(s, r).preempted
    assert preempted == ["low"]


def test_priority_policy_admits_by_priority_then_arrival():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for i, prio in enumerate([3, 1, 2, 1]):
        s.add_request(make_request(f"r{i}", [i] * 3, priority=prio, arrival=float(i)))
    assert [q.request_id for q in s.waiting_requests()] == ["r1", "r3", "r2", "r0"]
    s.set_priority("r0", 0)
    assert [q.request_id for q in s.waiting_requests()] == ["r0", "r1", "r3", "r2"]
    out = step(s, runner_for(s))
    assert [c.request.request_id for c in out.chunks] == ["r0"]


def test_lpm_admits_the_longest_cached_prefix_first():
    s = make_scheduler(max_num_seqs=1, policy="lpm")
    r = runner_for(s)
    drive(s, r, requests=[make_request("warm", list(range(12)), max_tokens=1)])
    s.add_request(make_request("cold", list(range(100, 112)), arrival=1.0))
    s.add_request(make_request("hot", list(range(12)) + [5], arrival=2.0))
    out = step(s, r)
    assert [c.request.request_id for c in out.chunks] == ["hot"]


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "finished"])
def test_abort_in_any_state_releases_everything(state):
    s = make_scheduler(num_blocks=16)
    r = runner_for(s)
    req = make_request("x", list(range(10)), max_tokens=4)
    s.add_request(req)
    if state != "waiting":
        step(s, r)
    if state == "preempted":
        assert s.preempt("x")
    if state == "finished":
        drive(s, r)
    s.finish("x")
    s.audit()
    assert not s.has_unfinished and s.tiers.device.counts().used == 0
    assert s.schedule().is_empty


@pytest.mark.parametrize("prompt_len, max_tokens, match", [
    (64, 1, "the prompt has 64 tokens"),
    (60, 10, "you asked for 70"),
])
def test_requests_longer_than_the_context_are_rejected(prompt_len, max_tokens, match):
    s = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError, match=match):
        s.add_request(make_request("x", [1] * prompt_len, max_tokens=max_tokens))
    assert not s.has_unfinished


def test_a_request_bigger_than_the_device_cache_is_rejected_not_queued():
    s = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="device cache holds only 4"):
        s.add_request(make_request("x", [1] * 17, max_tokens=4))
    s.add_request(make_request("ok", [1] * 12, max_tokens=4))     # 15 tokens of KV: 4 blocks fit
    drive(s, runner_for(s))


def test_stop_on_eos_stop_token_and_min_tokens():
    s = make_scheduler()
    eos = make_request("eos", [1, 2, 3], max_tokens=10)
    held = make_request("held", [4, 5, 6], max_tokens=10, min_tokens=3)
    stop = make_request("stop", [7, 8, 9], max_tokens=10, stop_token_ids=(7,))
    ignore = make_request("ignore", [1, 1, 1], max_tokens=2, ignore_eos=True)
    for request in (eos, held, stop, ignore):
        s.add_request(request)
    sampled = {"eos": EOS, "held": EOS, "stop": 7, "ignore": EOS}
    finished = s.update(s.schedule(), sampled)
    assert finished == [eos, stop]
    assert eos.status is stop.status is RequestStatus.FINISHED_STOPPED
    assert s.update(s.schedule(), sampled) == [ignore]              # by length, EOS ignored
    assert ignore.status is RequestStatus.FINISHED_LENGTH
    assert s.update(s.schedule(), sampled) == [held]                # EOS counts from min_tokens on
    assert held.num_output_tokens == 3
    s.audit()


def shared_prefix_requests(n, seed=0, block_size=4):
    rng = random.Random(seed)
    bases = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt = rng.choice(bases) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12),
                                     arrival=float(i), block_size=block_size))
    return requests


@pytest.mark.parametrize("num_blocks, budget", [(64, 32), (12, 5), (9, 3)])
def test_outputs_are_identical_with_prefix_caching_on_and_off(num_blocks, budget):
    """Tiny pools force preemptions and tiny budgets force chunking; outputs must not change."""
    results = []
    for caching in (True, False):
        s = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, max_model_len=40,
                           prefix_caching=caching)
        results.append(drive(s, runner_for(s), requests=shared_prefix_requests(30)))
    assert results[0] == results[1]


def test_prefix_caching_hits_and_free_count_returns_to_start():
    s = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=40)
    requests = shared_prefix_requests(30)
    drive(s, runner_for(s), requests=requests)
    assert sum(r.num_cached_tokens for r in requests) > 0
    counts = s.tiers.audit()["device"]
    assert counts.used == 0 and counts.in_flight == 0 and counts.free + counts.cached == 64


def test_a_shared_prefix_being_computed_is_waited_for_not_computed_twice():
    """Two requests with one long shared prefix arriving one step apart: the second waits for the
    first's prefill chunks and hits them, so the prefix is computed once; an unrelated request
    behind it is not held up meanwhile."""
    prefix = list(range(1, 41))                           # 10 blocks of 4
    s = make_scheduler(num_blocks=48, max_num_batched_tokens=24, max_model_len=64)
    r = runner_for(s)
    first, second = make_request("a", prefix + [91], max_tokens=2), make_request("b", prefix + [92], max_tokens=2)
    other = make_request("c", [7, 7, 7], max_tokens=2)
    s.add_request(first)
    computed = [c.num_tokens for c in step(s, r).chunks]
    s.add_request(second)
    s.add_request(other)
    out = s.schedule()                                    # a's second chunk is computing blocks b needs
    assert [c.request.request_id for c in out.chunks] == ["a", "c"] and s.tiers.waits_for_computing(second)
    s.update(out, r.execute(out))
    s.audit()
    computed += [c.num_tokens for c in out.chunks if c.request is not other]
    while s.has_unfinished:
        computed += [c.num_tokens for c in step(s, r).chunks if c.request is not other]
    assert second.num_cached_tokens == 40                 # every prefix block was a hit
    prompt_computed = sum(computed) - 2 * 2 + 2           # minus decode tokens (one each after the first)
    assert prompt_computed == len(first.prompt_token_ids) + 1, computed
    assert first.output_token_ids and second.output_token_ids


def test_without_prefix_caching_nothing_waits_for_blocks_being_computed():
    prefix = list(range(1, 41))
    s = make_scheduler(num_blocks=48, max_num_batched_tokens=24, max_model_len=64, prefix_caching=False)
    r = runner_for(s)
    s.add_request(make_request("a", prefix + [91], max_tokens=2))
    step(s, r)
    s.add_request(make_request("b", prefix + [92], max_tokens=2))
    assert "b" in [c.request.request_id for c in step(s, r).chunks]


def test_a_request_passed_over_still_waits_when_a_later_commit_raises(monkeypatch):
    """b is passed over (its next block is being computed); c's commit raises: b must still be queued."""
    prefix = list(range(1, 41))
    s = make_scheduler(num_blocks=48, max_num_batched_tokens=24, max_model_len=64)
    r = runner_for(s)
    s.add_request(make_request("a", prefix + [91], max_tokens=2))
    step(s, r)
    s.add_request(make_request("b", prefix + [92], max_tokens=2))
    s.add_request(make_request("c", [7, 7, 7], max_tokens=2))

    def commit_raises(plan):
        raise RuntimeError("injected: commit failed")
    monkeypatch.setattr(s.tiers, "commit", commit_raises)
    with pytest.raises(RuntimeError, match="injected"):
        s.schedule()
    assert [q.request_id for q in s.waiting_requests()] == ["b", "c"] and s.in_step[-1].request_id == "c"
    s.audit()
    monkeypatch.undo()
    while s.has_unfinished:
        step(s, r)


def test_a_short_prompt_behind_a_long_one_starts_at_once_when_nothing_decodes():
    """No decodes in the step (a prefill engine): a prompt longer than a step leaves half of each step to
    the prompts waiting for a seat, so a short one starts in the next step instead of after all of it;
    prompts of a step or less keep their order; the outputs are unchanged."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=8, max_model_len=64, prefix_caching=False)
    runner = FakeRunner(64, 4)
    long, short = make_request("long", list(range(100, 140)), max_tokens=1), make_request("short", [7, 8, 9], max_tokens=1)
    scheduler.add_request(long)
    assert [(c.request, c.num_tokens) for c in step(scheduler, runner).chunks] == [(long, 8)]
    scheduler.add_request(short)
    assert [(c.request, c.num_tokens) for c in step(scheduler, runner).chunks] == [(long, 4), (short, 3)]
    assert short.is_finished and not long.is_finished
    assert [(c.request, c.num_tokens) for c in step(scheduler, runner).chunks] == [(long, 8)]   # nobody waits
    drive(scheduler, runner)
    assert long.is_finished
    first, second = make_request("a", list(range(200, 206)), max_tokens=1), make_request("b", [1, 2, 3], max_tokens=1)
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert [(c.request, c.num_tokens) for c in step(scheduler, runner).chunks] == [(first, 6), (second, 2)]
    scheduler.audit()
