"""Draft proposals (kvstrata/scheduler/drafts.py): n-gram prompt lookup and predicted outputs."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.scheduler.drafts import JUDGED_AFTER, DraftProposer, judge, ngram_draft, prediction_draft, worth_drafting
from tests.kvcache.fakes import make_request


def reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, by brute force: for n from max_n down to min_n, the tokens after the most
    recent earlier occurrence of the latest n tokens that some token follows."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_longest_match_wins_then_the_most_recent():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [5, 1, 2, 7, 9, 1, 2, 8, 6, 3, 1, 2]
    assert ngram_draft(tokens, 3, 1, 4) == [8, 6, 3]          # "1 2" most recently followed by 8
    tokens = [4, 1, 2, 7, 9, 1, 2, 8, 6, 4, 1, 2]
    assert ngram_draft(tokens, 3, 1, 4) == [7, 9, 1]          # "4 1 2" is longer: the copy source
    assert ngram_draft(tokens, 3, 1, 2) == [8, 6, 4]          # capped at 2: the most recent "1 2"
    assert ngram_draft(tokens, 3, 4, 6) == []                 # nothing of 4 tokens recurs
    assert ngram_draft([1, 2], 3, 2, 4) == []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=60), st.integers(1, 6), st.integers(1, 4),
       st.integers(0, 40))
def test_ngram_draft_is_the_brute_force_definition(tokens, k, min_n, extra):
    assert ngram_draft(tokens, k, min_n, min_n + extra) == reference_ngram(tokens, k, min_n, min_n + extra)


def test_prediction_drafts_follow_the_copy_and_realign_after_an_edit():
    prediction = list(range(100, 140))
    assert prediction_draft(prediction, prediction[:5], 4) == [105, 106, 107, 108]
    edited = prediction[:10] + [7, 7] + prediction[10:14]       # two tokens inserted, then copying again
    assert prediction_draft(prediction, edited, 3) == [114, 115, 116]


def test_a_prediction_left_behind_drafts_from_the_requests_own_tokens():
    """After an edit the prediction has no occurrence of (a rename's new name recurs in the output,
    not in the prediction): the draft comes from n-gram lookup in the prompt and output instead."""
    prediction = list(range(100, 140))
    renamed = [prediction[0], 7, 8, 9, prediction[2], prediction[3], 50, 7, 8]    # `7 8 9` replaced `101`
    request = make_request("r", [1, 2, 3], max_tokens=64)
    request.prediction_token_ids = tuple(prediction)
    for token in renamed:
        request.append_output(token)
    assert prediction_draft(prediction, renamed, 4) == []
    assert DraftProposer().propose(request, 4) == [9, prediction[2], prediction[3], 50]
    request.append_output(9)
    assert DraftProposer().propose(request, 2) == [prediction[2], prediction[3]]   # what followed `7 8 9` before


def test_drafts_stop_at_the_first_that_would_not_pay():
    """The j-th draft pays while a^j beats the break-even, a the request's recent chance per draft:
    a stream drafts its K, a large batch a few; unjudged requests and predictions draft all."""
    request = make_request("r", [1, 2, 3, 4])
    assert worth_drafting(request, 0.5, 8) == 8                      # not judged yet
    for _ in range(JUDGED_AFTER):
        judge(request, 8, 4, 0.05)                                  # 4 accepted, then a rejection: a = 0.8
    assert worth_drafting(request, 0.05, 8) == 8                    # 0.8^8 = 0.17 > 0.05
    assert worth_drafting(request, 0.48, 8) == 3                    # 0.8^3 = 0.51, 0.8^4 = 0.41
    assert worth_drafting(request, 0.9, 8) == 0
    for _ in range(10):
        judge(request, 2, 2, 0.05)                                  # all accepted lately: a -> 0.96
    assert worth_drafting(request, 0.48, 8) > 3
    request.prediction_token_ids = (5, 6)
    assert worth_drafting(request, 0.9, 8) == 8
