"""A property test proves only what it reached: each run counts the states it hit, and one it never hit fails."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


def assert_reached(reached: Counter, states: Iterable[str], machine: str) -> None:
    """Print what `machine`'s runs reached; fail naming each of `states` they never reached."""
    print(f"{machine} reached:", dict(sorted(reached.items())))
    missing = [state for state in states if not reached[state]]
    assert not missing, f"the {machine} never reached {missing}: it proves nothing about them ({dict(reached)})"
