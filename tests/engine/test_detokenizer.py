"""Incremental detokenization never emits half a character and honours stop strings."""

import pytest

from kvstrata.engine.detokenizer import IncrementalDetokenizer

TEXT = "Crème brûlée, 你好世界 and 🙂🚀 — ok"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2.tokenizer


def stream(tokenizer, ids, stop=()):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False), stop)
    pieces, found = [], None
    for token in ids:
        found = detok.add(token)
        pieces.append(detok.delta(final=found is not None))
        if found:
            break
    pieces.append(detok.delta(final=True))
    return pieces, found


def test_deltas_join_to_the_full_text_without_replacement_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces, _ = stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert any(piece == "" for piece in pieces)        # some tokens are partial characters


def test_stop_string_cuts_text_and_is_held_back_while_streaming(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False)
    pieces, found = stream(tokenizer, ids, stop=("gamma",))
    assert found == "gamma"
    assert "".join(pieces) == "alpha beta "
