from __future__ import annotations

import math

import numpy as np
import pytest

from metrics import names
from metrics.observation import DEFAULT_SLO
from metrics.quantile import histogram_quantile
from metrics.samples import exact_quantile


def test_grid_is_finer_near_each_threshold() -> None:
    b = np.array(names.slo_buckets([1.0, 0.1]))
    ratios = b[1:] / b[:-1]
    for t in (1.0, 0.1):
        near = (b[:-1] >= t / 1.3) & (b[1:] <= t * 1.3)
        assert near.sum() >= 20
        assert ratios[near].max() <= names.NEAR_BUCKET_RATIO + 1e-9
    assert ratios.max() <= names.MAX_BUCKET_RATIO + 1e-9


def test_exported_prefix_and_sample_names() -> None:
    assert names.exported(names.TTFT_SECONDS, prefix="") == "slotune_ttft_seconds"
    assert names.histogram_samples(names.TTFT_SECONDS)[0] == "ray_slotune_ttft_seconds_bucket"
    assert names.counter_samples(names.REQUESTS_TOTAL, prefix="") == (
        "slotune_requests_total",
        "slotune_requests_total_total",
    )
    with pytest.raises(ValueError, match="prefix"):
        names.exported(names.TTFT_SECONDS, prefix="bad-")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_layout_p99_within_5pct_near_the_slo(seed: int) -> None:
    # The accuracy bar, on one realistic window (2,000 requests); the full sweep is
    # bench/metrics_accuracy.py.
    rng = np.random.default_rng(seed)
    bounds = names.slo_buckets([DEFAULT_SLO.ttft_p99_s])
    raw = np.concatenate([rng.lognormal(0, 0.3, 1970), 5 * rng.lognormal(0, 0.3, 30)])
    for f in (0.8, 0.9, 1.0, 1.1, 1.25):
        x = np.sort(raw * (f / exact_quantile(raw, 0.99)))
        le = np.searchsorted(x, bounds, side="right").astype(float)  # [len(bounds)]
        counts = dict(zip(bounds, le, strict=True))
        counts[math.inf] = float(x.size)
        exact = exact_quantile(x, 0.99)
        assert abs(histogram_quantile(0.99, counts) - exact) / exact <= 0.05
