"""Small assertion helpers shared by the tests (run inside rank processes)."""

from __future__ import annotations


def raises(fn, exc, *needles) -> str | None:
    """None if ``fn()`` raises ``exc`` whose message contains every needle, else what went wrong
    (returned, not raised, so that every rank's findings come back to the test)."""
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        return f"message lacks {missing}: {e}" if missing else None
    return f"no {exc.__name__} raised"
