"""ScrapeSource on Ray's real metrics export port: Ray's rendering of histograms and counters
(prefix, ``le`` format, ``_total``, extra labels) reads back to the exact request counts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from metrics import names
from metrics.build import observation_from_requests
from metrics.observation import Observation, Slo
from metrics.sources import ScrapeSource

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)
# A private family prefix, so this probe never collides with serving's own registrations of
# the contract names in the same cluster: Ray exports it as ray_probe_slotune_*.
EMIT_PREFIX = "probe_"


def test_scrape_source_reads_rays_export(ray_cluster) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def __init__(self, ttft_bounds: list[float], tpot_bounds: list[float]) -> None:
            from ray.util import metrics as m

            tags = ("deployment",)
            self.ttft = m.Histogram(
                EMIT_PREFIX + names.TTFT_SECONDS, boundaries=ttft_bounds, tag_keys=tags
            )
            self.tpot = m.Histogram(
                EMIT_PREFIX + names.TPOT_SECONDS, boundaries=tpot_bounds, tag_keys=tags
            )
            self.req = m.Counter(
                EMIT_PREFIX + names.REQUESTS_TOTAL, tag_keys=(*tags, names.LABEL_SLO_MET)
            )
            self.tok = m.Counter(EMIT_PREFIX + names.GENERATED_TOKENS_TOTAL, tag_keys=tags)

        def record(self, ttft: list[float], tpot: list[float], slo: Slo) -> None:
            for a, b in zip(ttft, tpot, strict=True):
                t = {"deployment": "probe"}
                self.ttft.observe(a, tags=t)
                self.tpot.observe(b, tags=t)
                met = a <= slo.ttft_p99_s and b <= slo.tpot_p99_s
                self.req.inc(1.0, tags={**t, names.LABEL_SLO_MET: "true" if met else "false"})
                self.tok.inc(5.0, tags=t)

    rng = np.random.default_rng(5)
    ttft = rng.lognormal(np.log(0.3), 0.6, 600)
    tpot = rng.lognormal(np.log(0.04), 0.35, 600)
    probe = Probe.remote(
        list(names.slo_buckets([SLO.ttft_p99_s])), list(names.slo_buckets([SLO.tpot_p99_s]))
    )
    src = ScrapeSource(
        ray_cluster.metrics_url,
        slo=SLO,
        prefix="ray_" + EMIT_PREFIX,
        selector={"deployment": "probe"},
    )
    s0 = src.snapshot()
    ray.get(probe.record.remote(ttft.tolist(), tpot.tolist(), SLO))
    deadline = time.monotonic() + 40
    obs: Observation | None = None
    while time.monotonic() < deadline:
        obs = src.observe(s0, src.snapshot())
        # Each series reaches the export port in its own report: wait for all of them.
        if (
            obs.completed >= 600
            and obs.generated_tokens >= 3000
            and obs.ttft_verdict
            and obs.ttft_verdict.samples >= 600
            and obs.tpot_verdict
            and obs.tpot_verdict.samples >= 600
        ):
            break
        time.sleep(0.5)
    assert obs is not None and not obs.stale, obs and obs.note
    ref = observation_from_requests(slo=SLO, start_s=0, end_s=1, ttft_s=ttft, tpot_s=tpot)
    assert (obs.completed, obs.slo_met, obs.generated_tokens) == (600, ref.slo_met, 3000)
    for got, want in ((obs.ttft_verdict, ref.ttft_verdict), (obs.tpot_verdict, ref.tpot_verdict)):
        assert got is not None and want is not None
        assert (got.verdict, got.samples) == (want.verdict, want.samples)
        assert got.exceed_fraction_upper == want.exceed_fraction_upper
    assert obs.ttft.p99 == pytest.approx(ref.ttft.p99, rel=0.1)
