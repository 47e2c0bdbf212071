"""Structured output (grammars and token masks) and tool calls (rendering and parsing)."""
