"""How far one tick moves the batch limit, once controller/control/decide.py has decided
that it moves: a cut sized from the batch that ran, a raise topped by the curve's
prediction and by the batch a raise on trial read over the band at, and the multiplicative
step down. Pure arithmetic on the policy and the window's gauges.
"""

from __future__ import annotations

import math

from controller.control.gauges import FULL_BATCH, running_batch
from controller.control.policy import Policy
from metrics.observation import Observation


def step_down(x: int, policy: Policy) -> int:
    """``x`` x ``decrease``, by at most ``max_step`` of it and at least 1."""
    bounded = max(math.floor(x * policy.decrease), math.ceil(x * (1 - policy.max_step)))
    return min(x - 1, bounded)


def loosen_to(b: int, p99: float, policy: Policy, below: float, *, top: int | None = None) -> int:
    """The largest batch above ``b``, up to ``top`` and by at most ``max_step``, whose p99
    TPOT the curve predicts under ``below`` of the SLO from ``p99`` at ``b``; ``b`` when
    none is."""
    hi = max(b + 1, math.floor(b * (1 + policy.max_step)))
    hi = min(policy.batch_max, hi if top is None else min(hi, top))
    goal = below * policy.slo.tpot_p99_s
    return next((x for x in range(hi, b, -1) if policy.predict_tpot_s(b, p99, x) <= goal), b)


def raise_cap(ceiling: tuple[int, float] | None, b: int) -> tuple[int | None, str]:
    """The largest batch a raise may reach under ``ceiling`` (the batch a raise on trial read
    over the TPOT band at, and until when), or None without one; and, where that leaves no
    room above ``b``, why a raise holds ("" where it does not)."""
    if ceiling is None:
        return None, ""
    cap = ceiling[0] - 1
    why = f"B={cap + 1} read over the TPOT band on trial after a raise: no raise to it yet"
    return cap, why if cap <= b else ""


def cut_to(o: Observation, b: int, policy: Policy, share: float, below: float) -> int:
    """The batch limit a TPOT cut from the limit ``b`` sets, with p99 TPOT at ``share`` of
    its SLO: x ``decrease``, or deeper for a large overshoot, as far as p99 in proportion
    to the batch (the steepest a decode step grows) would take it under ``below``, by at
    most ``max_step``. Not by the canary's curve: measured under another load, it is
    flatter than the hour's, and cuts taken from it overshot (a simulated day lost 4-9% of
    goodput that way).

    From the batch the replicas ran, when short of the limit: a cut from the limit alone
    does not reach it for ticks (live, with ~20 running under B=32 the limit came down a
    tick at a time before TPOT moved)."""
    run = running_batch(o, b)
    nb = step_down(run, policy)
    floor = min(nb, max(policy.batch_min, math.ceil(run * (1 - policy.max_step))))
    if math.isfinite(share) and share > 0:
        nb = max(floor, min(nb, math.floor(run * below / share)))
    if run < b:
        # nb is the batch to run, and a limit that binds runs only a share of itself
        # (arrivals wait a step to join): what ran, where the limit bound, else FULL_BATCH.
        # The limit that runs nb is nb / that share. A limit of nb itself cut ~10% deeper
        # than meant (a simulated day's 100.5% window took 67 running to 55, and the flat
        # curve never let it back)
        fill = max(FULL_BATCH, o.running / b)
        nb = min(b - 1, math.floor(nb / fill))
    return max(policy.batch_min, nb)
