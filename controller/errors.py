"""Errors the CLI turns into one line and an exit code."""

from __future__ import annotations


class BadInput(ValueError):
    """A value the user gave is not allowed; the message names it and what is allowed.

    The CLI prints it on one line and exits with code 2.
    """


class NoFeasiblePoint(RuntimeError):
    """Every configuration measured was judged to violate the SLO (exit code 3: the canary
    gate fails)."""


class Worse(RuntimeError):
    """``slotune compare``: run B's operating point is worse than run A's beyond noise (exit
    code 5, so that a pipeline can gate a rollout on it)."""


class NotComparable(RuntimeError):
    """``slotune compare``: neither run has an operating point to compare (exit code 6)."""


class Undecided(RuntimeError):
    """No configuration was shown to meet the SLO, yet some were not shown to violate it
    either (exit code 4: no verdict; the message names the best candidate, its evidence
    and what would decide it)."""
