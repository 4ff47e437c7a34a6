"""The simulated deployment the tuner tests share: the SLO and space they search, the
optimistic roofline the tuner is given, and one noisy measurement window of a known curve."""

from __future__ import annotations

import numpy as np

from metrics.observation import Observation, Percentiles, Slo, SloVerdict, Verdict
from search.space import SearchSpace

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.05)
SPACE = SearchSpace(batch_min=1, batch_max=256, headroom_max=4.0)


def model_tpot(b: int) -> float:
    """The 'peak roofline' the tuner is given: optimistic by ~2x."""
    return 0.008 + 0.0006 * b


def _verdict(est: float, thr: float) -> SloVerdict:
    """MET/VIOLATED with a 2% margin, INSUFFICIENT near the threshold, as a real window."""
    if est <= 0.98 * thr:
        verdict = Verdict.MET
    elif est > 1.02 * thr:
        verdict = Verdict.VIOLATED
    else:
        verdict = Verdict.INSUFFICIENT
    return SloVerdict(
        verdict=verdict, threshold_s=thr, estimate_s=est, samples=1000, confidence=0.95
    )


def noisy_window(
    tpot: float, ttft: float, goodput: float, *, rng: np.random.Generator, noise: float
) -> Observation:
    """A 60 s window of the true (tpot, ttft, goodput), scaled by one log-normal draw from
    ``rng``; a third of the completions meet the SLO when either latency misses it."""
    f = float(np.exp(rng.normal(0, noise)))
    tpot, ttft, goodput = tpot * f, ttft * f, goodput / f
    tv, pv = _verdict(ttft, SLO.ttft_p99_s), _verdict(tpot, SLO.tpot_p99_s)
    ok = tv.verdict is Verdict.MET and pv.verdict is Verdict.MET
    n = round(goodput * 60)
    return Observation(
        start_s=0.0,
        end_s=60.0,
        completed=n,
        slo_met=n if ok else n // 3,
        ttft=Percentiles(p99=ttft),
        tpot=Percentiles(p99=tpot),
        ttft_verdict=tv,
        tpot_verdict=pv,
    )
