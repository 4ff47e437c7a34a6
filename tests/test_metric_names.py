from __future__ import annotations

import math

import pytest

from metrics import names
from metrics.observation import DEFAULT_SLO


def test_buckets_contain_thresholds_and_are_dense() -> None:
    b = names.slo_buckets([0.05, 1.0, 0.123])
    for t in (0.05, 1.0, 0.123):
        assert t in b
    assert list(b) == sorted(b) and len(set(b)) == len(b)
    ratios = [hi / lo for lo, hi in zip(b, b[1:], strict=False)]
    assert max(ratios) <= names.MAX_BUCKET_RATIO + 1e-9
    assert math.isclose(b[0], 1e-3) and math.isclose(b[-1], 120.0)


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_buckets_reject_bad_threshold(bad: float) -> None:
    with pytest.raises(ValueError, match="SLO threshold"):
        names.slo_buckets([bad])


def test_exported_name() -> None:
    assert names.exported(names.TTFT_SECONDS) == "ray_slotune_ttft_seconds"
    with pytest.raises(ValueError):
        names.exported("foo")


def test_cluster_layouts_hold_defaults_and_round_slos_exactly() -> None:
    for bounds, default, standard in (
        (names.TTFT_BUCKETS, DEFAULT_SLO.ttft_p99_s, names.STANDARD_TTFT_SLOS_S),
        (names.TPOT_BUCKETS, DEFAULT_SLO.tpot_p99_s, names.STANDARD_TPOT_SLOS_S),
    ):
        assert default in bounds and set(standard) <= set(bounds)
        assert list(bounds) == sorted(set(bounds))
        ratios = [hi / lo for lo, hi in zip(bounds, bounds[1:], strict=False)]
        assert max(ratios) <= names.MAX_BUCKET_RATIO + 1e-9
