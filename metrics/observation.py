"""What the controller decides from: an SLO and an Observation of one window."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray


@dataclass(frozen=True, kw_only=True)
class Slo:
    """Latency SLO on a quantile (p99 by default) of TTFT and TPOT, in seconds."""

    ttft_p99_s: float
    tpot_p99_s: float
    quantile: float = 0.99

    def __post_init__(self) -> None:
        for name in ("ttft_p99_s", "tpot_p99_s"):
            v = getattr(self, name)
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if not (number and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r}: must be a positive number of seconds")
        if not 0 < self.quantile < 1:
            raise ValueError(f"quantile={self.quantile!r}: must be in (0, 1)")

    @overload
    def met(self, ttft_s: float, tpot_s: float) -> bool: ...
    @overload
    def met(
        self, ttft_s: NDArray[np.float64], tpot_s: NDArray[np.float64]
    ) -> NDArray[np.bool_]: ...
    def met(self, ttft_s: Any, tpot_s: Any) -> Any:
        """Whether a request met BOTH thresholds: the per-request rule behind goodput.

        ``ttft_s <= ttft_p99_s`` and ``tpot_s <= tpot_p99_s``, where a NaN TPOT means the
        request has no inter-token time (a single token) and is judged on TTFT alone; a NaN
        TTFT (no first token) never meets. Works on floats and, elementwise, on numpy arrays.
        """
        # x != x is NaN's test for a float and for an array alike.
        return (ttft_s <= self.ttft_p99_s) & ((tpot_s != tpot_s) | (tpot_s <= self.tpot_p99_s))


# The SLO a deployment gets when none is given; the cluster-wide histogram layouts
# (metrics/names.py) are finest around it.
DEFAULT_SLO = Slo(ttft_p99_s=1.0, tpot_p99_s=0.1)


class Verdict(str, enum.Enum):
    MET = "met"
    VIOLATED = "violated"
    INSUFFICIENT = "insufficient"  # not enough samples to tell either way


@dataclass(frozen=True, kw_only=True)
class SloVerdict:
    """Whether the quantile meets its threshold, with the evidence behind the call."""

    verdict: Verdict
    threshold_s: float
    estimate_s: float  # the quantile as measured (nan when unknown)
    samples: int  # observations the verdict rests on
    confidence: float  # e.g. 0.95
    # Upper confidence bound on the fraction of samples above the threshold.
    exceed_fraction_upper: float = math.nan
    exceed_fraction_lower: float = math.nan
    # The histogram bucket (lower, upper bound) the threshold lies strictly inside, when it
    # is not a bound: the count above it is then only known to a range, and the verdict
    # takes the side that cannot flatter it. None when exact (a bound, or raw samples).
    bracket_s: tuple[float, float] | None = None


@dataclass(frozen=True, kw_only=True)
class Percentiles:
    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One measurement window of a serving deployment (any source)."""

    start_s: float  # unix seconds
    end_s: float
    completed: int  # requests finished in the window
    slo_met: int  # of those, requests that met BOTH SLOs
    rejected: int = 0  # requests refused before admission, for any reason
    # Of ``rejected``, those refused for want of room (HTTP 429: the admission limit and
    # the queue were full): demand beyond the limits. The rest were bad requests (400,
    # 413), which more room would not serve.
    overloaded: int = 0
    generated_tokens: int = 0
    ttft: Percentiles = field(default_factory=Percentiles)
    tpot: Percentiles = field(default_factory=Percentiles)
    ttft_verdict: SloVerdict | None = None
    tpot_verdict: SloVerdict | None = None
    staleness_s: float = 0.0  # age of the newest data point when read
    stale: bool = False
    source: str = ""
    note: str = ""  # why the window is stale or thin, in words (empty when all is well)
    # False when the source cannot tell which requests met the SLO: a server with no
    # SLO-labelled completion counter (vLLM, SGLang). ``slo_met`` is then 0 and
    # ``goodput_rps`` NaN: goodput must come from the client's own records
    # (``metrics.build.with_client_goodput``).
    slo_met_known: bool = True
    # Requests in the decode batch, per replica, and requests waiting for a place in it,
    # all replicas together: each the mean over the window (NaN when the server exports
    # neither gauge). The batch runs below its limit when demand is short of it.
    running: float = math.nan
    waiting: float = math.nan
    # (replica, its p99 TPOT estimate in seconds, its requests) of every replica, where the
    # source can tell replicas apart (one slow replica is seen, not averaged away)
    replica_tpot: tuple[tuple[str, float, int], ...] = ()
    # The window's TTFT and TPOT as requests per bucket (``metrics.binned.Binned``: the
    # server's histogram, or the raw samples binned): what two windows are compared on.
    ttft_hist: tuple[tuple[float, int], ...] = ()
    tpot_hist: tuple[tuple[float, int], ...] = ()

    @property
    def window_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def goodput_rps(self) -> float:
        """Completed requests per second that met both the TTFT and the TPOT SLO (NaN when
        the source cannot tell: ``slo_met_known`` is False)."""
        if not self.slo_met_known:
            return math.nan
        return self.slo_met / self.window_s if self.window_s > 0 else math.nan

    @property
    def throughput_rps(self) -> float:
        return self.completed / self.window_s if self.window_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.window_s if self.window_s > 0 else math.nan

    @property
    def feasible(self) -> bool:
        """Both SLOs met with confidence, on fresh data."""
        return (
            not self.stale
            and self.ttft_verdict is not None
            and self.tpot_verdict is not None
            and self.ttft_verdict.verdict is Verdict.MET
            and self.tpot_verdict.verdict is Verdict.MET
        )
