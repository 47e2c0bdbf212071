"""Continuous batching: which tokens of which requests each step computes (ids and counts, never blocks)."""
