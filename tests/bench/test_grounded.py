"""The input-grounded workloads (prompts that the reply quotes or edits) and the speculative-decoding
figures `kvstrata bench offline` reports for them."""

import json

import pytest

from kvstrata.bench.cases import Speculation, read_cases, write_cases
from kvstrata.bench.grounded import GROUNDED, grounded_case, grounded_prompts
from kvstrata.bench.texts import PASSAGES, SOURCES
from kvstrata.entrypoints.cli.main import main


def _chat(messages: list[dict]) -> list[int]:          # a stand-in template
    return [1] + [ord(c) for c in messages[0]["content"]] + [2]


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_code_edits_ask_for_the_whole_file_back_and_name_real_identifiers():
    edits = grounded_prompts("code-edit")
    assert len(edits) == 2 * sum(len(s.renames) for s in SOURCES)
    for source in SOURCES:
        for old, new in source.renames:
            assert old in source.text and new not in source.text, (source.name, old, new)
            asks = [p for p in edits if f"`{old}` to `{new}`" in p.message or f"`{old}` should be called `{new}`"
                    in p.message]
            assert asks and all(source.text in p.message and p.prediction is None for p in asks)


def test_predicted_edits_carry_the_original_file_as_their_prediction():
    plain, predicted = grounded_prompts("code-edit"), grounded_prompts("code-edit-predicted")
    assert [p.message for p in plain] == [p.message for p in predicted]
    for p in predicted:
        assert p.prediction.startswith("```") and p.prediction.removeprefix("```").split("\n", 1)[1][:-3] in p.message


def test_summaries_quote_passages_and_chat_has_nothing_to_quote():
    summaries = grounded_prompts("quote-summary")
    assert {p for passage in PASSAGES for p in summaries if passage.text in p.message} == set(summaries)
    chats = grounded_prompts("chat")
    assert chats and all(len(p.message) < 120 and p.prediction is None for p in chats)
    with pytest.raises(ValueError, match="code-edit"):
        grounded_prompts("poetry")


@pytest.mark.parametrize("kind", list(GROUNDED))
def test_cases_deal_distinct_prompts_to_each_repeat_and_round_trip(kind, tmp_path):
    case = grounded_case(kind, 2, 3, 16, _chat, _encode)
    again = grounded_case(kind, 2, 3, 16, _chat, _encode)
    assert case == again and case.name == f"{kind} x2" and [len(r) for r in case.repeats] == [2, 2, 2]
    dealt = [tuple(p) for r in case.repeats for p in r]
    assert len(set(dealt)) == len(dealt), "no prompt twice while variants last"
    assert (case.predictions is not None) == (kind == "code-edit-predicted")
    if case.predictions:
        assert [len(r) for r in case.predictions] == [2, 2, 2] and all(case.predictions[0])
    write_cases(tmp_path / "cases.json", [case])
    assert read_cases(tmp_path / "cases.json") == [case]


def test_cases_wrap_around_when_variants_run_out():
    chats = len(grounded_prompts("chat"))
    case = grounded_case("chat", chats, 2, 8, _chat, _encode)
    assert case.repeats[0] == case.repeats[1]


def test_speculation_figures_follow_vllm():
    s = Speculation(drafts=10, draft_tokens=40, accepted_tokens=25)
    assert s.acceptance_rate == pytest.approx(0.625)
    assert s.mean_acceptance_length == pytest.approx(3.5)          # 1 + accepted per verification
    assert "acceptance rate 62%" in s.describe() and "mean acceptance length 3.50 over 10" in s.describe()
    assert Speculation(0, 0, 0).acceptance_rate == 0.0 and Speculation(0, 0, 0).mean_acceptance_length == 1.0


def _offline(tmp_path, name: str, *flags: str) -> dict:
    figures = tmp_path / f"{name}.json"
    assert main(["bench", "offline", "--num-prompts", "1", "--repeats", "1", "--output-len", "24",
                 "--dtype", "float32", "--kv-cache-memory", "64MiB", "--audit-every-step", "--json", str(figures),
                 *flags]) == 0
    return json.loads(figures.read_text())["cases"][0]


@pytest.mark.slow     # 21 s: the grounded cases with and without drafts
def test_bench_offline_reports_acceptance_and_keeps_greedy_outputs(tmp_path, capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    plain = _offline(tmp_path, "plain", "--workload", "quote-summary")
    ngram = _offline(tmp_path, "ngram", "--workload", "quote-summary", "--speculative-config", spec)
    predicted = _offline(tmp_path, "predicted", "--workload", "code-edit-predicted")
    assert plain["speculation"] is None and plain["steps"] >= 24
    for case in (ngram, predicted):
        s = Speculation(**case["speculation"])
        assert 0 < s.accepted_tokens <= s.draft_tokens and s.drafts <= case["steps"]
        assert case["steps"] < 24, "accepted drafts save steps"
    assert ngram["output_digests"] == plain["output_digests"], "float32 greedy: the same tokens with speculation"
    out = capsys.readouterr().out
    assert "quote-summary x1: speculative decoding, acceptance rate" in out
    assert "code-edit-predicted x1: speculative decoding, acceptance rate" in out
