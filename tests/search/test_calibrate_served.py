"""The served-step model: the fit, its predictions, its storage and the plan it seeds."""

from __future__ import annotations

import math

import pytest

from search.calibrate.served import (
    SERVED_VERSION,
    ServedModel,
    ServedPoint,
    fit_line,
    served_cache_path,
)


def _served(**kw: object) -> ServedModel:
    pts = [
        ServedPoint(batch=1, tpot_p50_s=0.015, tpot_p99_s=0.025),
        ServedPoint(batch=4, tpot_p50_s=0.030, tpot_p99_s=0.050),
        ServedPoint(batch=16, tpot_p50_s=0.090, tpot_p99_s=0.150),
    ]
    args: dict[str, object] = dict(
        model="slotune-small", device="cpu-x", threads=1, prompt_tokens=16, output_tokens=8
    )
    args.update(kw)
    return ServedModel.fit(pts, **args)  # type: ignore[arg-type]


def test_fit_line_is_least_squares_and_never_negative() -> None:
    assert fit_line([1, 2, 3], [2, 4, 6]) == pytest.approx((0.0, 2.0))
    assert fit_line([1, 4, 16], [0.02, 0.05, 0.17]) == pytest.approx((0.01, 0.01))
    a, b = fit_line([1, 4], [0.05, 0.04])  # falling: the (weighted) mean
    assert b == 0.0 and 0.04 < a < 0.05
    a, b = fit_line([1, 4, 16], [0.001, 0.05, 0.2])
    assert a == 0.0 and b > 0  # a negative intercept: through the origin


def test_the_model_predicts_the_line_and_the_largest_batch_within_the_slo() -> None:
    s = _served()
    assert s.tpot_s(16) == pytest.approx(s.intercept_s + 16 * s.slope_s)
    assert s.max_residual < 0.15
    b = s.largest_batch_within(0.1, max_batch=128)
    assert b is not None and s.tpot_s(b) <= 0.1 < s.tpot_s(b + 1)
    assert s.largest_batch_within(0.1, max_batch=5) == 5
    assert s.largest_batch_within(0.001, max_batch=128) is None
    assert s.prefill_share == pytest.approx(16 / 24)


def test_the_workload_must_match_to_use_the_model() -> None:
    s = _served()
    assert s.matches(prompt_tokens=17, output_tokens=8)
    assert not s.matches(prompt_tokens=16, output_tokens=64)


def test_round_trip_and_version() -> None:
    s = _served(measured_at="now", elapsed_s=3.0)
    d = s.to_dict()
    assert ServedModel.from_dict(d) == s
    assert d["version"] == SERVED_VERSION and "prefill_share" in d
    with pytest.raises(ValueError, match="version"):
        ServedModel.from_dict({**d, "version": SERVED_VERSION + 1})
    with pytest.raises(ValueError, match="malformed"):
        ServedModel.from_dict({"version": SERVED_VERSION})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(threads=0), "threads=0"),
        (dict(prompt_tokens=math.nan), "prompt_tokens"),
        (dict(model=""), "model"),
    ],
)
def test_bad_values_are_named(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _served(**kw)


def test_a_point_needs_a_tpot() -> None:
    with pytest.raises(ValueError, match="tpot_p99_s"):
        ServedPoint(batch=1, tpot_p50_s=0.01, tpot_p99_s=math.nan)
    with pytest.raises(ValueError, match="batch"):
        ServedPoint(batch=0, tpot_p50_s=0.01, tpot_p99_s=0.02)


def test_the_cache_sits_beside_the_device_calibration(tmp_path) -> None:
    hw = tmp_path / "hardware-host-cpu-x-1t.json"
    assert served_cache_path(hw, "slotune-small") == (
        tmp_path / "hardware-host-cpu-x-1t-served-slotune-small.json"
    )


def test_the_plan_seeds_from_the_served_model_and_tells_the_tuner_it() -> None:
    from controller import tune_plan
    from metrics.observation import Slo
    from search.roofline.hardware import resolve_hardware

    slo = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
    kw = dict(
        model="small", hardware=resolve_hardware("h100-sxm"), slo=slo, price=None, max_slots=128
    )
    roof = tune_plan.plan_search(**kw, context=20)  # type: ignore[arg-type]
    s = _served()
    plan = tune_plan.plan_search(**kw, context=20, served=s)  # type: ignore[arg-type]
    want = s.largest_batch_within(0.1, max_batch=plan.space.batch_max)
    assert plan.seed_batch == want == plan.seeds[0].max_batch_size
    assert plan.space == roof.space  # the roofline still bounds the box
    assert plan.model_tpot_s is not None and plan.model_tpot_s(7) == s.tpot_s(7)
    assert "served-step model" in plan.reason
    assert plan.model_curve[6].tpot_s == pytest.approx(s.tpot_s(7))
    assert roof.model_curve == roof.predicted
