"""Knobs and the search space: validation, the log box, and the bounds the roofline proves."""

from __future__ import annotations

import pytest

from metrics.observation import Slo
from search.roofline.curve import Roofline
from search.roofline.hardware import resolve_hardware
from search.roofline.models import resolve_model
from search.space import PARAM_BATCH, PARAM_HEADROOM, Knobs, SearchSpace

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.02)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_batch_size": 0, "max_concurrency": 4}, "max_batch_size=0"),
        ({"max_batch_size": 2.5, "max_concurrency": 4}, "max_batch_size=2.5"),
        ({"max_batch_size": True, "max_concurrency": 4}, "max_batch_size=True"),
        ({"max_batch_size": 8, "max_concurrency": 4}, "max_concurrency=4 < max_batch_size=8"),
    ],
)
def test_knobs_reject_bad_values_naming_them(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Knobs(**kw)


def test_space_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="batch_max=0"):
        SearchSpace(batch_max=0)
    with pytest.raises(ValueError, match="headroom_max=0.5"):
        SearchSpace(batch_max=8, headroom_max=0.5)


def test_params_round_trip_and_concurrency_never_below_batch() -> None:
    space = SearchSpace(batch_min=1, batch_max=256, headroom_max=4.0)
    d = space.distributions()
    assert d[PARAM_BATCH].log and d[PARAM_HEADROOM].log
    for k in (
        Knobs(max_batch_size=1, max_concurrency=1),
        Knobs(max_batch_size=37, max_concurrency=90),
    ):
        assert space.knobs_from_params(space.params_from_knobs(k)) == k
    for b, h in ((1, 1.0), (5, 1.3), (256, 4.0), (100, 1.001)):
        k = space.knobs_from_params({PARAM_BATCH: b, PARAM_HEADROOM: h})
        assert k.max_concurrency >= k.max_batch_size


def test_clip_keeps_the_box() -> None:
    space = SearchSpace(batch_min=2, batch_max=64, headroom_max=2.0)
    k = space.clip(Knobs(max_batch_size=500, max_concurrency=5000))
    assert k == Knobs(max_batch_size=64, max_concurrency=128)
    assert space.contains(k)
    assert not space.contains(Knobs(max_batch_size=1, max_concurrency=1))


def test_bounded_by_kv_capacity_and_by_the_peak_step_time() -> None:
    step = lambda b: 0.005 + 0.0001 * b  # noqa: E731 - peak step time, s
    # TPOT bound: 0.005 + 0.0001 b <= 0.02  <=>  b <= 150.
    assert SearchSpace.bounded(step_time_s=step, max_batch_memory=1000, slo=SLO).batch_max == 150
    # KV capacity binds first.
    assert SearchSpace.bounded(step_time_s=step, max_batch_memory=40, slo=SLO).batch_max == 40


def test_bounded_refuses_an_impossible_slo() -> None:
    with pytest.raises(ValueError, match="tpot_p99_s=0.001"):
        SearchSpace.bounded(
            step_time_s=lambda b: 0.005,
            max_batch_memory=10,
            slo=Slo(ttft_p99_s=1, tpot_p99_s=0.001),
        )
    with pytest.raises(ValueError, match="max_batch_memory=0"):
        SearchSpace.bounded(step_time_s=lambda b: 0.005, max_batch_memory=0, slo=SLO)


def test_from_roofline_excludes_exactly_what_the_peak_roofline_rules_out() -> None:
    r = Roofline(
        model=resolve_model("llama-3.1-8b"), hardware=resolve_hardware("h100-sxm"), context=4096
    )
    slo = Slo(ttft_p99_s=1.0, tpot_p99_s=0.008)
    space = SearchSpace.from_roofline(r, slo)
    b = space.batch_max
    assert b <= r.max_batch_memory
    assert r.step_time_s(b) <= slo.tpot_p99_s
    assert b == r.max_batch_memory or r.step_time_s(b + 1) > slo.tpot_p99_s
