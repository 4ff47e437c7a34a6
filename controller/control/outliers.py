"""Replicas much slower than the rest in a window: named in the tick's reason, never
averaged away. The decision stays the fleet's, on the p99 across replicas
(controller/control/decide.py). Pure."""

from __future__ import annotations

import math
import statistics

from controller.control.policy import Policy
from metrics.observation import Observation

# A replica is an outlier when its p99 TPOT is this many times the median of the others',
# over tighten_at of the SLO, on at least min_requests of its own requests.
OUTLIER_RATIO = 1.5


def outliers(o: Observation, policy: Policy) -> list[tuple[str, str]]:
    """(replica, what to say) of each replica much slower than the others in the window."""
    known = [(r, p99, n) for r, p99, n in o.replica_tpot if math.isfinite(p99)]
    if len(known) < 2:
        return []
    out = []
    for r, p99, n in known:
        mid = statistics.median(x for rr, x, _ in known if rr != r)
        if (
            n >= policy.min_requests
            and p99 >= policy.tighten_at * policy.slo.tpot_p99_s
            and p99 >= OUTLIER_RATIO * mid
        ):
            out.append(
                (
                    r,
                    f"replica {r} p99 TPOT {p99 * 1e3:.0f} ms, {p99 / mid:.1f}x the others' "
                    f"{mid * 1e3:.0f} ms (a slow node or device? it is not averaged away)",
                )
            )
    return out
