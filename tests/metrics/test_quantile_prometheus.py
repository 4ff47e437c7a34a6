"""histogram_quantile against a real Prometheus: the same answer to 1e-9 on many inputs."""

from __future__ import annotations

import math
import random

import pytest

from metrics.quantile import bucket_quantile
from tests.fixtures.prometheus_server import PrometheusServer, TextEndpoint

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

QS = (0.0, 0.25, 0.5, 0.9, 0.99, 0.999, 1.0, -0.5, 1.5, 0.123456789)
Case = list[tuple[str, float, float]]  # (le as written, bound, cumulative count)


def le_text(b: float, alt: bool = False) -> str:
    if math.isinf(b):
        return "+Inf" if not alt else "inf"
    return repr(b) if not alt else f"{b:.17e}"


def count_text(c: float) -> str:
    return "NaN" if math.isnan(c) else repr(c)


def gen_cases(rng: random.Random, n: int) -> list[Case]:
    cases: list[Case] = [
        [("+Inf", math.inf, 5.0)],  # single bucket
        [("1.0", 1.0, 3.0), ("2.0", 2.0, 4.0)],  # no +Inf
        [("1.0", 1.0, 0.0), ("+Inf", math.inf, 0.0)],  # zero observations
        [("-1.0", -1.0, 5.0), ("1.0", 1.0, 10.0), ("+Inf", math.inf, 10.0)],  # negative first
        [("0.0", 0.0, 5.0), ("1.0", 1.0, 10.0), ("+Inf", math.inf, 10.0)],  # zero first
        [("1.0", 1.0, 1.0), ("2.0", 2.0, 2.0), ("+Inf", math.inf, 100.0)],  # rank in +Inf
        [("1.0", 1.0, 10.0), ("2.0", 2.0, 5.0), ("3.0", 3.0, 20.0), ("+Inf", math.inf, 20.0)],
        [("1", 1.0, 4.0), ("1.0", 1.0, 6.0), ("2", 2.0, 20.0), ("+Inf", math.inf, 20.0)],  # dup
        [("0.5", 0.5, math.nan), ("1.0", 1.0, 3.0), ("+Inf", math.inf, 4.0)],  # NaN count
    ]
    while len(cases) < n:
        k = rng.randint(1, 14)
        bounds = sorted({round(rng.lognormvariate(-1, 1.5), rng.randint(1, 6)) for _ in range(k)})
        if rng.random() < 0.1:
            bounds = sorted({*bounds, -rng.random(), 0.0})
        counts: list[float] = []
        c = 0.0
        for _ in bounds:
            c += rng.choice([0.0, rng.random() * 10, float(rng.randint(0, 50))])
            counts.append(c)
        total = c + rng.choice([0.0, rng.random() * 3, float(rng.randint(0, 20))])
        if rng.random() < 0.15 and counts:  # a dip, as after a per-bucket counter reset
            i = rng.randrange(len(counts))
            counts[i] *= rng.random()
        case: Case = [(le_text(b), b, cnt) for b, cnt in zip(bounds, counts, strict=True)]
        if rng.random() < 0.9:
            case.append(("+Inf", math.inf, total))
        if rng.random() < 0.15 and case:  # the same bound written two ways
            le, b, cnt = rng.choice(case)
            case.append((le_text(b, alt=True), b, rng.random() * 5))
        if rng.random() < 0.05:
            case = [(le, b, 0.0) for le, b, _ in case]
        cases.append(case)
    return cases


def exposition(cases: list[Case]) -> str:
    lines = ["# TYPE hq_bucket untyped"]
    for i, case in enumerate(cases):
        for le, _, cnt in case:
            lines.append(f'hq_bucket{{case="{i}",le="{le}"}} {count_text(cnt)}')
    return "\n".join(lines) + "\n"


def same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300)


def test_histogram_quantile_matches_prometheus(prometheus_server: PrometheusServer) -> None:
    cases = gen_cases(random.Random(20261202), 400)
    endpoint = TextEndpoint(exposition(cases))
    try:
        with prometheus_server.scraping("quantile_cases", endpoint.address):
            n_series = sum(len(c) for c in cases)
            prometheus_server.wait_for(
                f'count(hq_bucket{{job="quantile_cases"}}) == {n_series}', timeout_s=20
            )
            at = prometheus_server.last_scrape_s("quantile_cases")
            mismatches = []
            compared = 0
            for q in (*QS, math.nan):
                res = prometheus_server.query(
                    f'histogram_quantile({q!r}, hq_bucket{{job="quantile_cases"}})'.replace(
                        "nan", "NaN"
                    ),
                    at=at,
                )
                got = {int(r["metric"]["case"]): float(r["value"][1]) for r in res}
                assert set(got) == set(range(len(cases)))
                for i, case in enumerate(cases):
                    ours = bucket_quantile(q, [(b, c) for _, b, c in case])
                    compared += 1
                    if not same(ours, got[i]):
                        mismatches.append((q, i, case, ours, got[i]))
            assert compared == len(cases) * (len(QS) + 1)
            # The inputs exercise interpolation, not only the NaN paths.
            finite = sum(
                1
                for q in (0.5, 0.9)
                for c in cases
                if math.isfinite(bucket_quantile(q, [(b, n) for _, b, n in c]))
            )
            assert finite > len(cases)
            assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[:3]}"
    finally:
        endpoint.close()
