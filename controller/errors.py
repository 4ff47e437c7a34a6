"""Errors the CLI turns into one line and an exit code."""

from __future__ import annotations


class BadInput(ValueError):
    """A value the user gave is not allowed; the message names it and what is allowed.

    The CLI prints it on one line and exits with code 2.
    """


class NoFeasiblePoint(RuntimeError):
    """Every configuration measured was judged to violate the SLO (exit code 3: the canary
    gate fails)."""


class Undecided(RuntimeError):
    """No configuration was shown to meet the SLO, yet some were not shown to violate it
    either (exit code 4: no verdict; the message names the best candidate, its evidence
    and what would decide it)."""
