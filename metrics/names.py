"""The metric contract: every name, label and bucket layout serving emits and readers read.

Names carry the ``slotune_`` prefix and base units. Ray Serve exports custom
metrics from ``ray.serve.metrics`` with a ``ray_`` prefix on its metrics export
port; :func:`exported` maps an emitted name to the name seen there.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from metrics.observation import DEFAULT_SLO

PREFIX = "slotune_"
RAY_PREFIX = "ray_"

# Histograms (seconds).
TTFT_SECONDS = "slotune_ttft_seconds"
TPOT_SECONDS = "slotune_tpot_seconds"
QUEUE_WAIT_SECONDS = "slotune_queue_wait_seconds"
# TTFT on the replica's own clock (from when Serve handed it the request): what
# TTFT_SECONDS measured before it started at Serve's proxy; the gap between the two is
# the proxy, routing and Serve's router queue (docs/serving.md "Metrics").
REPLICA_TTFT_SECONDS = "slotune_replica_ttft_seconds"

# Counters.
REQUESTS_TOTAL = "slotune_requests_total"  # completed requests, label slo_met
GENERATED_TOKENS_TOTAL = "slotune_generated_tokens_total"
REJECTED_TOTAL = "slotune_rejected_requests_total"  # label reason: REJECTED_REASONS
# Accepted requests (admitted or queued in the replica) that did not complete, label reason
# (ABORTED_REASONS); what they did get (first token, tokens) is in the TTFT histogram and
# the tokens counter. Not completions: no slo_met count, no goodput.
ABORTED_TOTAL = "slotune_aborted_requests_total"
# Completion requests by the clock their TTFT started on, label clock (ARRIVAL_CLOCKS):
# "front_door" (Serve's proxy stamped the arrival) or "replica" (no stamp reached it).
ARRIVAL_CLOCK_TOTAL = "slotune_arrival_clock_total"

# Gauges.
RUNNING_REQUESTS = "slotune_running_requests"
WAITING_REQUESTS = "slotune_waiting_requests"
KV_CACHE_USAGE_RATIO = "slotune_kv_cache_usage_ratio"
MAX_BATCH_SIZE = "slotune_max_batch_size"

# The controller's own metrics (metrics/exporter.py), served by the controller itself.
CONTROLLER_KNOB = "slotune_controller_knob"  # gauge, label knob
CONTROLLER_TRIALS_TOTAL = "slotune_controller_trials_total"  # counter
CONTROLLER_BEST_GOODPUT_RPS = "slotune_controller_best_goodput_rps"  # gauge
CONTROLLER_GOODPUT_RPS = "slotune_controller_goodput_rps"  # gauge, last observed window
CONTROLLER_SLO_VERDICT = "slotune_controller_slo_verdict"  # gauge 0/1, labels slo, verdict
CONTROLLER_QUANTILE_SECONDS = "slotune_controller_observed_quantile_seconds"  # label slo
CONTROLLER_ROLLBACKS_TOTAL = "slotune_controller_rollbacks_total"  # counter
CONTROLLER_STALE = "slotune_controller_metrics_stale"  # gauge 0/1
# slotune control: decisions by action and outcome, and the rollback latch
CONTROLLER_DECISIONS_TOTAL = "slotune_controller_decisions_total"  # labels action, outcome
CONTROLLER_DEGRADED = "slotune_controller_degraded"  # gauge 0/1
CONTROLLER_OUTLIERS = "slotune_controller_outlier_replicas"  # gauge, last window
# the TPOT band slotune control steered by in the last window, as shares of the SLO, and the
# spread of p99 TPOT from window to window it was lowered for (NaN before it is known)
CONTROLLER_TPOT_BAND = "slotune_controller_tpot_band_share"  # gauge, label edge
CONTROLLER_TPOT_SPREAD = "slotune_controller_tpot_window_spread"  # gauge

# Labels.
LABEL_SLO_MET = "slo_met"  # "true" | "false"
LABEL_REASON = "reason"
LABEL_KNOB = "knob"
LABEL_SLO = "slo"  # "ttft" | "tpot"
LABEL_VERDICT = "verdict"  # a metrics.observation.Verdict value
LABEL_CLOCK = "clock"  # ARRIVAL_CLOCKS
LABEL_ACTION = "action"  # a controller.control.decide.Action value
LABEL_OUTCOME = "outcome"  # a controller.control.decide.Outcome value

# Values of LABEL_REASON.
REASON_BAD_REQUEST = "bad_request"  # a 4xx other than 413 and 429
REASON_TOO_LARGE = "too_large"  # 413: the body is over the size limit
REASON_OVERLOADED = "overloaded"  # 429: the admission limit and the queue are full
REASON_CLIENT_DISCONNECT = "client_disconnect"  # the client left before the end
REASON_ERROR = "error"  # the server failed the request
REJECTED_REASONS = (REASON_BAD_REQUEST, REASON_TOO_LARGE, REASON_OVERLOADED)
ABORTED_REASONS = (REASON_CLIENT_DISCONNECT, REASON_ERROR)

# Values of LABEL_CLOCK.
CLOCK_FRONT_DOOR = "front_door"  # Serve's HTTP proxy, before routing (serving/app/front_door.py)
CLOCK_REPLICA = "replica"  # the replica, when Serve handed it the request
ARRIVAL_CLOCKS = (CLOCK_FRONT_DOOR, CLOCK_REPLICA)

HISTOGRAMS = (TTFT_SECONDS, TPOT_SECONDS, QUEUE_WAIT_SECONDS, REPLICA_TTFT_SECONDS)
COUNTERS = (
    REQUESTS_TOTAL,
    GENERATED_TOKENS_TOTAL,
    REJECTED_TOTAL,
    ABORTED_TOTAL,
    ARRIVAL_CLOCK_TOTAL,
)
GAUGES = (RUNNING_REQUESTS, WAITING_REQUESTS, KV_CACHE_USAGE_RATIO, MAX_BATCH_SIZE)

# Neighbouring bucket bounds are at most this ratio apart everywhere in range...
MAX_BUCKET_RATIO = 1.1
# ...and at most this ratio apart within a factor NEAR_SPAN of each SLO threshold.
NEAR_BUCKET_RATIO = 1.025
NEAR_SPAN = 1.35


_PROM_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


# Ray's metric API takes no ':' in a name: vLLM's Ray stat logger replaces every character
# outside [a-zA-Z0-9_] with '_' before registering (vllm-project/vllm,
# vllm/v1/metrics/ray_wrappers.py, ``_get_sanitized_opentelemetry_name``), and Ray's
# export port then prefixes the namespace ``ray_``: vllm:time_to_first_token_seconds is
# read there as ray_vllm_time_to_first_token_seconds.
_RAY_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def read_as(name: str, *, prefix: str) -> str:
    """The name under which a metric emitted as ``name`` is read at an endpoint.

    ``prefix=""``: as emitted (a plain prometheus_client exporter). Any other prefix (Ray's
    ``"ray_"``): characters Ray does not allow become ``_``, then the prefix goes in front.
    This is the one place that mapping lives, for every metrics profile.
    """
    full = prefix + _RAY_UNSAFE.sub("_", name) if prefix else name
    if not _PROM_NAME.fullmatch(full):
        raise ValueError(f"prefix {prefix!r}: {full!r} is not a valid Prometheus metric name")
    return full


def exported(name: str, *, prefix: str = RAY_PREFIX) -> str:
    """The family name under which one of slotune's own metrics is read: ``prefix + name``.

    ``prefix`` is ``"ray_"`` on Ray's metrics export port (the default) and ``""`` for a
    plain prometheus_client exporter (:func:`read_as`).
    """
    if not name.startswith(PREFIX):
        raise ValueError(f"metric name {name!r} must start with {PREFIX!r}")
    return read_as(name, prefix=prefix)


def counter_samples(name: str, *, prefix: str = RAY_PREFIX) -> tuple[str, ...]:
    """Sample names a counter may be exposed under, most specific first.

    A counter named ``..._total`` is exposed as is by prometheus_client (and by Ray, which
    renders counters through it), but an exporter that appends ``_total`` to every counter
    would show ``..._total_total``: readers take the first of these that has any series.
    """
    full = read_as(name, prefix=prefix)
    return (full, full + "_total")


def histogram_samples(name: str, *, prefix: str = RAY_PREFIX) -> tuple[str, str, str]:
    """``(_bucket, _count, _sum)`` sample names of an exported histogram."""
    full = read_as(name, prefix=prefix)
    return (full + "_bucket", full + "_count", full + "_sum")


def slo_buckets(
    thresholds: Iterable[float],
    *,
    lo: float = 1e-3,
    hi: float = 120.0,
    max_ratio: float = MAX_BUCKET_RATIO,
    near_ratio: float = NEAR_BUCKET_RATIO,
    near_span: float = NEAR_SPAN,
) -> tuple[float, ...]:
    """Finite histogram bounds from ``lo`` to ``hi`` that contain every threshold exactly.

    Bounds form a geometric grid no more than ``max_ratio`` apart; each threshold is
    inserted as-is, so "fraction of requests above the SLO" is read exactly from the
    bucket counts. Within a factor ``near_span`` of each threshold the grid is finer
    (``near_ratio``, centred on the threshold), so a p99 near the SLO is interpolated
    within a bucket ≤2.5% wide (bench/metrics_accuracy.py measures the effect).
    """
    if not (0 < lo < hi) or not math.isfinite(hi):
        raise ValueError(f"bucket range lo={lo!r}, hi={hi!r}: need 0 < lo < hi < inf")
    if not max_ratio > 1:
        raise ValueError(f"max_ratio={max_ratio!r}: must be > 1")
    if not 1 < near_ratio <= max_ratio:
        raise ValueError(f"near_ratio={near_ratio!r}: must be in (1, max_ratio={max_ratio!r}]")
    if not near_span >= 1:
        raise ValueError(f"near_span={near_span!r}: must be >= 1")
    extra = []
    for t in thresholds:
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"SLO threshold {t!r}: must be a positive finite number of seconds")
        extra.append(float(t))
    n = math.ceil(math.log(hi / lo) / math.log(max_ratio))
    step = (hi / lo) ** (1.0 / n)
    grid = [lo * step**i for i in range(n + 1)]
    grid[-1] = hi
    k = math.floor(math.log(near_span) / math.log(near_ratio))
    spans = [(t / near_ratio**k, t * near_ratio**k) for t in extra]
    coarse = {b for b in grid if not any(a < b < z for a, z in spans)}
    fine = {t * near_ratio**i for t in extra for i in range(-k, k + 1)}
    bounds = {round(b, 12) for b in coarse | fine if lo <= b <= hi} | set(extra)
    return tuple(sorted(bounds))


# Ray's metrics agent keeps the first bucket layout registered under a metric name and
# silently drops every later histogram of that name with other bounds (measured with
# Ray 2.60: a second app's TTFT histogram never reached the export port). So every
# replica in a cluster uses ONE layout, whatever SLO it was deployed with: the default
# thresholds with the fine grid around them, plus the round SLO values people set,
# each an exact bound so "requests above the SLO" is exact for them. Any other SLO
# still lands on a grid <= MAX_BUCKET_RATIO apart and its verdict is bracketed.
STANDARD_TTFT_SLOS_S = (
    0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 10.0,
)  # fmt: skip
STANDARD_TPOT_SLOS_S = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.08, 0.1, 0.125,
    0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
)  # fmt: skip


def cluster_buckets(default_s: float, standard_s: Iterable[float]) -> tuple[float, ...]:
    """The one layout a metric uses cluster-wide: fine around ``default_s``, exact at each
    of ``standard_s``, <= MAX_BUCKET_RATIO apart everywhere."""
    return tuple(sorted(set(slo_buckets([default_s])) | {float(t) for t in standard_s}))


TTFT_BUCKETS = cluster_buckets(DEFAULT_SLO.ttft_p99_s, STANDARD_TTFT_SLOS_S)
TPOT_BUCKETS = cluster_buckets(DEFAULT_SLO.tpot_p99_s, STANDARD_TPOT_SLOS_S)
QUEUE_WAIT_BUCKETS = TTFT_BUCKETS
