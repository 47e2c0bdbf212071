"""docs/serving-api.md and docs/configuration.md hold what the code renders (kvstrata.entrypoints.cli.reference),
and a change to a request model, a refused field or a flag's help shows up as a stale document."""

import argparse
from pathlib import Path

import pytest

from kvstrata.entrypoints.cli import reference
from kvstrata.entrypoints.cli.main import build_parser
from kvstrata.entrypoints.openai import protocol

DOCS = Path(__file__).resolve().parents[2] / "docs"
STALE = "{} is stale: the code renders it differently; run `make docs` and commit the result"


@pytest.mark.parametrize("name", ["serving-api.md", "configuration.md"])
def test_the_reference_docs_are_what_the_code_renders(name):
    path = DOCS / name
    text = path.read_text()
    assert reference.update(text, reference.documents(DOCS)[path]) == text, STALE.format(f"docs/{name}")


def _action(parser: argparse.ArgumentParser, command: str, flag: str) -> argparse.Action:
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return next(a for a in subs.choices[command]._actions if flag in a.option_strings)


def test_a_changed_help_string_makes_the_configuration_stale():
    text = (DOCS / "configuration.md").read_text()
    parser = build_parser()
    _action(parser, "serve", "--port").help = "the TCP port, said another way"
    changed = reference.update(text, reference.render_configuration(parser))
    assert changed != text and "the TCP port, said another way" in changed


def test_a_refused_field_is_read_from_unsupported(monkeypatch):
    text = (DOCS / "serving-api.md").read_text()
    assert "| `suffix` | string | `null` | refused (400) unless `null` |" in text
    monkeypatch.delitem(protocol.UNSUPPORTED, "suffix")
    changed = reference.update(text, reference.render_serving_api())
    assert "| `suffix` | string | `null` | supported |" in changed


def test_a_field_or_an_endpoint_without_a_description_fails_to_render(monkeypatch):
    monkeypatch.delitem(reference.FIELDS, "top_k")
    with pytest.raises(KeyError, match="SamplingBody.top_k"):
        reference.render_serving_api()
    monkeypatch.delitem(reference.ENDPOINTS, "/tokenize")
    with pytest.raises(KeyError, match="/tokenize"):
        reference.render_serving_api()


def test_the_markers_must_be_there():
    with pytest.raises(ValueError, match="reference:commands:begin"):
        reference.update("# Configuration\n", reference.render_configuration())
