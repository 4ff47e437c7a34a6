from __future__ import annotations

import math

import numpy as np
import pytest

from metrics.build import observation_from_histograms, observation_from_requests
from metrics.observation import Slo, Verdict

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)


def test_from_requests_counts_goodput_on_both_slos() -> None:
    ttft = [0.5, 0.5, 2.0, 0.5]
    tpot = [0.05, 0.2, 0.05, math.nan]  # the last is a single-token request
    obs = observation_from_requests(slo=SLO, start_s=10, end_s=12, ttft_s=ttft, tpot_s=tpot)
    assert (obs.completed, obs.slo_met) == (4, 2)
    assert obs.goodput_rps == 1.0 and obs.throughput_rps == 2.0
    assert obs.tpot_verdict is not None and obs.tpot_verdict.samples == 3
    assert obs.ttft_verdict is not None and obs.ttft_verdict.verdict is Verdict.VIOLATED
    assert obs.ttft.p50 == 0.5 and obs.ttft.p99 == 2.0


def test_from_requests_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="tpot_s has 1"):
        observation_from_requests(slo=SLO, start_s=0, end_s=1, ttft_s=[0.1, 0.2], tpot_s=[0.1])
    with pytest.raises(ValueError, match="NaN"):
        observation_from_requests(slo=SLO, start_s=0, end_s=1, ttft_s=[math.nan], tpot_s=[0.1])


def test_from_requests_feasible_only_with_enough_clean_requests() -> None:
    rng = np.random.default_rng(0)
    ttft = rng.uniform(0.1, 0.5, 400)
    tpot = rng.uniform(0.01, 0.05, 400)
    obs = observation_from_requests(slo=SLO, start_s=0, end_s=10, ttft_s=ttft, tpot_s=tpot)
    assert obs.feasible
    few = observation_from_requests(
        slo=SLO, start_s=0, end_s=10, ttft_s=ttft[:20], tpot_s=tpot[:20]
    )
    assert not few.feasible
    assert few.ttft_verdict is not None and few.ttft_verdict.verdict is Verdict.INSUFFICIENT


def test_from_histograms_rounds_extrapolated_counts_and_keeps_nan_when_unknown() -> None:
    obs = observation_from_histograms(
        slo=SLO, start_s=0, end_s=10, met=99.6, missed=0.4,
        ttft_buckets=None, tpot_buckets={0.1: 0.0, math.inf: 0.0},
    )  # fmt: skip
    assert (obs.completed, obs.slo_met) == (100, 100)
    assert math.isnan(obs.ttft.p99) and math.isnan(obs.tpot.p50)
    assert obs.ttft_verdict is not None and obs.ttft_verdict.verdict is Verdict.INSUFFICIENT
    with pytest.raises(ValueError, match="met"):
        observation_from_histograms(
            slo=SLO, start_s=0, end_s=1, met=math.nan, missed=0, ttft_buckets={}, tpot_buckets={}
        )


@pytest.mark.parametrize(
    ("ttft", "tpot", "met"),
    [
        (0.5, 0.05, True),
        (1.0, 0.1, True),  # at the threshold meets it
        (1.1, 0.05, False),
        (0.5, 0.2, False),
        (0.5, math.nan, True),  # a single token: judged on TTFT alone
        (1.1, math.nan, False),
        (math.nan, 0.05, False),  # no first token never meets
    ],
)
def test_slo_met_is_one_rule_for_floats_and_arrays(ttft: float, tpot: float, met: bool) -> None:
    assert SLO.met(ttft, tpot) is met
    both = SLO.met(np.array([ttft, 0.5]), np.array([tpot, 0.05]))
    assert both.dtype == bool and both.tolist() == [met, True]
