"""How a target fails: transient (retry the window) or permanent (stop the run)."""

from __future__ import annotations


class TargetUnavailable(RuntimeError):
    """A transient failure (metrics endpoint down, a timeout): the loop retries the window."""


class TargetError(RuntimeError):
    """A permanent failure (the deployment is gone, an update was refused): stop the run."""
