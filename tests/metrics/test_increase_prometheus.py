"""Counter-reset handling equals Prometheus's increase() on the same scrapes."""

from __future__ import annotations

import pytest

from metrics.quantile import counter_increase
from tests.fixtures.prometheus_server import PrometheusServer, TextEndpoint

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

# Two series scraped at the same instants; "b" restarts twice (a replica restart).
SEQUENCE = [(0.0, 0.0), (10.0, 4.0), (25.0, 1.0), (31.0, 0.5), (44.0, 6.5)]


def test_counter_increase_matches_prometheus(prometheus_server: PrometheusServer) -> None:
    def body(a: float, b: float) -> str:
        head = "# TYPE resets_total counter\n"
        return head + f'resets_total{{s="a"}} {a!r}\nresets_total{{s="b"}} {b!r}\n'

    ep = TextEndpoint(body(*SEQUENCE[0]))
    try:
        with prometheus_server.scraping("resets", ep.address):
            t_first = prometheus_server.last_scrape_s("resets")
            for a, b in SEQUENCE[1:]:
                ep.body = body(a, b)
                prometheus_server.wait_scrapes("resets", 1)
            t_end = prometheus_server.last_scrape_s("resets")
            window_ms = round((t_end - t_first + 0.5) * 1000)
            res = prometheus_server.query(
                f'increase(resets_total{{job="resets"}}[{window_ms}ms])', at=t_end
            )
            got = {r["metric"]["s"]: float(r["value"][1]) for r in res}  # type: ignore[index]
    finally:
        ep.close()
    # Each value was scraped at least once (possibly more: repeats add 0 either way).
    ours = {
        s: sum(counter_increase(x[i], y[i]) for x, y in zip(SEQUENCE, SEQUENCE[1:], strict=False))
        for i, s in enumerate(("a", "b"))
    }
    assert ours == {"a": 44.0, "b": 4.0 + 1.0 + 0.5 + 6.0}
    assert got == pytest.approx(ours, rel=1e-9)
