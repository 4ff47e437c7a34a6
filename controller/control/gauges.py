"""What a window's running and waiting gauges say about the batch limit: whether it held
the batch, the batch the replicas ran under it, and whether demand queued beyond it. Pure;
controller/control/decide.py sizes its cuts and gates its loosening and its TPOT band on
them.
"""

from __future__ import annotations

import math

from metrics.observation import Observation, Verdict
from search.space import Knobs

# The share of its limit a batch must run at, on average, for waiting requests to be
# waiting for the limit: with continuous batching every arrival waits for a step to join,
# so some always wait (live under B=32: 4 clients, 0-0.5 waiting on average; 20 clients,
# 1.3-3.2 waiting beside 15-17 running).
FULL_BATCH = 0.9


def queued(o: Observation, limit: int) -> bool:
    """Demand beyond the limit: requests refused for want of room (not bad requests, which
    more room would not serve), or waiting while the batch runs full (waiting alone counts
    where the source has no running gauge)."""
    if o.overloaded > 0:
        return True
    if not (math.isfinite(o.waiting) and o.waiting > 0):
        return False
    return not math.isfinite(o.running) or o.running >= FULL_BATCH * limit


def holds_the_batch(o: Observation, knobs: Knobs) -> bool:
    """Whether the limit held the window's batch: it ran full (``FULL_BATCH`` of the limit),
    or requests queued for it (waiting, with the admission limit at the batch limit and p99
    TTFT judged over its SLO: live, 24 clients under B=15 ran 10-12 with about one waiting,
    as requests came and went); or the source has no running gauge to tell."""
    if not math.isfinite(o.running):
        return True
    if o.running >= FULL_BATCH * knobs.max_batch_size:
        return True
    ttft = o.ttft_verdict
    return (
        knobs.max_concurrency == knobs.max_batch_size
        and math.isfinite(o.waiting)
        and o.waiting > 0
        and ttft is not None
        and ttft.verdict is Verdict.VIOLATED
    )


def running_batch(o: Observation, limit: int) -> int:
    """The batch the replicas ran in the window: the mean running requests per replica,
    rounded up, when the source has them and they are short of the limit; else the limit."""
    if math.isfinite(o.running) and 0 < o.running < limit:
        return max(1, math.ceil(o.running))
    return limit
