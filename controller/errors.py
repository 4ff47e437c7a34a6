"""Errors the CLI turns into one line and an exit code."""

from __future__ import annotations


class BadInput(ValueError):
    """A value the user gave is not allowed; the message names it and what is allowed.

    The CLI prints it on one line and exits with code 2.
    """


class NoFeasiblePoint(RuntimeError):
    """No configuration met the SLO (exit code 3: a canary gate)."""
