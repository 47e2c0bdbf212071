"""The step cost the engine learns from its own steps, and the prefill it allows under a time target."""

import random

import numpy as np

from kvstrata.scheduler.step_cost import MAX_VARIANCE, MIN_STEPS, QUEUE_RATIO, STRETCH, StepCostModel


def trained(base=0.02, per_token=0.0006, per_decode=0.001, steps=200, seed=0):
    model = StepCostModel()
    rng = random.Random(seed)
    for _ in range(steps):
        prefill, decodes = rng.choice([0, 0, rng.randrange(1, 512)]), rng.randrange(0, 32)
        model.observe(prefill, decodes, base + per_token * prefill + per_decode * decodes + rng.gauss(0, 0.002))
    return model


def test_the_fit_finds_the_cost_of_a_step():
    base, per_token, per_decode = trained().theta
    assert abs(base - 0.02) < 0.003 and abs(per_token - 0.0006) < 0.00003 and abs(per_decode - 0.001) < 0.0003


def test_the_limit_fills_the_target_and_stretches_when_decodes_alone_are_slow():
    model = trained()
    decoding = 0.02 + 0.001 * 8                                   # 28 ms: 0.15 s leaves 122 ms for prefill
    assert abs(model.prefill_limit(0.15, 8, 64, 2048) - (0.15 - decoding) / 0.0006) < 15
    assert abs(model.prefill_limit(0.01, 8, 64, 2048) - (STRETCH - 1) * decoding / 0.0006) < 15
    assert model.prefill_limit(0.15, 8, 64, 100) == 100                   # never above the step budget
    assert trained(per_token=0.01).prefill_limit(0.05, 8, 64, 2048) == 64  # never below the floor


def test_the_target_grows_when_many_more_requests_wait_than_decode():
    model = trained()
    decoding = 0.02 + 0.001 * 8
    alone = model.prefill_limit(0.15, 8, 64, 4096)
    assert model.prefill_limit(0.15, 8, 64, 4096, waiting=8 * QUEUE_RATIO) == alone     # up to the ratio: as is
    waiting = 8 * QUEUE_RATIO * 3                                                     # three times over it
    assert abs(model.prefill_limit(0.15, 8, 64, 4096, waiting=waiting) - (3 * 0.15 - decoding) / 0.0006) < 15
    assert model.prefill_limit(0.15, 8, 64, 2048, waiting=1000) == 2048    # never above the step budget


def test_the_forgetting_fit_follows_a_host_that_slows_down():
    model = trained()
    rng = random.Random(1)
    for _ in range(150):                                             # the host now runs at half speed
        prefill, decodes = rng.randrange(0, 512), rng.randrange(0, 32)
        model.observe(prefill, decodes, 2 * (0.02 + 0.0006 * prefill + 0.001 * decodes))
    base, per_token, _ = model.theta
    assert abs(per_token - 0.0012) < 0.0001 and abs(base - 0.04) < 0.008


def test_a_long_stretch_without_prefill_leaves_the_fit_whole():
    """Covariance windup: forgetting grows the directions no step excites by 1/FORGETTING a step; 40,000
    decode-only steps (~20 busy minutes) once overflowed the prefill direction into NaN for good, and every
    later step got only the floor. Bounded, the fit comes back as soon as prefill does, drafts' fit too."""
    model = trained()
    before = model.prefill_limit(0.15, 8, 64, 2048)
    for step in range(40_000):
        model.observe(0, 8 + step % 5, 0.02 + 0.001 * (8 + step % 5))
    assert np.isfinite(model.split.inverse).all() and np.isfinite(model.drafts.inverse).all()
    assert np.linalg.eigvalsh(model.split.inverse).max() <= MAX_VARIANCE * (1 + 1e-9)
    for _ in range(50):
        model.observe(256, 8, 0.02 + 0.0006 * 256 + 0.001 * 8)
    assert abs(model.prefill_limit(0.15, 8, 64, 2048) - before) < 15 and before > 64


def test_a_young_fit_does_not_cut():
    model = StepCostModel()
    for _ in range(MIN_STEPS - 1):
        model.observe(100, 4, 0.5)
    assert model.prefill_limit(0.01, 4, 64, 2048) == 2048
    decode_only = StepCostModel()
    for _ in range(4 * MIN_STEPS):
        decode_only.observe(0, 4, 0.03)                       # no prefill yet: the slope is unknown
    assert decode_only.prefill_limit(0.01, 4, 64, 2048) == 2048


def test_a_draft_pays_above_its_rows_share_of_a_decode_step_per_decoding_request():
    """A draft row priced by its own slope (here 1.5 ms, dearer than a decode's 1 ms and a prefill
    token's 0.6), over the decode-only step the fit predicts at that many decodes."""
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(200):
        prefill, decodes = rng.choice([0, 0, rng.randrange(1, 512)]), rng.randrange(1, 32)
        drafts = rng.choice([0, 4 * rng.randrange(0, decodes + 1)])
        model.observe(prefill, decodes, 0.02 + 0.0006 * prefill + 0.001 * decodes + 0.0015 * drafts
                      + rng.gauss(0, 0.002), drafts)
    assert abs(model.draft_break_even(1) - 0.0015 / (0.02 + 0.001)) < 0.01         # one stream: ~7%
    assert abs(model.draft_break_even(32) - 0.048 / (0.02 + 0.032)) < 0.05         # a batch: ~92%
    assert model.draft_break_even(64) > model.draft_break_even(32) > model.draft_break_even(1)
    assert trained().draft_break_even(1) is None               # no draft seen: the scheduler's default
    young = StepCostModel()
    young.observe(100, 1, 0.1, drafts=4)
    assert young.draft_break_even(1) is None                   # until the fit is trusted: the default
