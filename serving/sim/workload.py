"""Synthetic request streams for the simulator: arrivals and prompt/output lengths.

A :class:`Workload` is Poisson arrivals at ``rate_rps`` (or a replayed trace of
arrival offsets) with prompt and output lengths from :class:`LengthDist`.
Everything is drawn from a numpy ``Generator`` handed in, so a seed fixes it.
:class:`LengthDist` is also the load generator's (controller.load.spec) request shape.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "lognormal")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    """Token counts (prompt or output lengths), clipped to [lo, hi].

    ``fixed``: always ``mean``; ``uniform``: on [lo, hi]; ``lognormal``: with mean ``mean``
    and shape ``sigma`` (the standard deviation of the log; :meth:`lognormal` takes a
    coefficient of variation instead). Two samplers, each reproducible from its seed: the
    simulator's :meth:`sample` draws ``n`` at once from a numpy ``Generator``, the load
    generator's :meth:`sample_one` one at a time from a ``random.Random``.
    """

    kind: str = "fixed"
    mean: int
    sigma: float = 0.5
    lo: int = 1
    hi: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"kind={self.kind!r}: choose one of {LENGTH_KINDS}")
        if not (_is_int(self.lo) and _is_int(self.hi) and 1 <= self.lo <= self.hi):
            raise ValueError(f"lo={self.lo!r}, hi={self.hi!r}: need integers 1 <= lo <= hi")
        if not (_is_int(self.mean) and self.lo <= self.mean <= self.hi):
            raise ValueError(
                f"mean={self.mean!r}: must be an integer in [lo={self.lo}, hi={self.hi}]"
            )
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"sigma={self.sigma!r}: must be a finite number >= 0")

    @classmethod
    def lognormal(cls, *, mean: int, cv: float, lo: int, hi: int) -> LengthDist:
        """A lognormal with mean ``mean`` and coefficient of variation ``cv`` (std / mean)."""
        if not (math.isfinite(cv) and cv >= 0):
            raise ValueError(f"cv={cv!r}: must be a finite number >= 0")
        return cls(kind="lognormal", mean=mean, sigma=math.sqrt(math.log1p(cv**2)), lo=lo, hi=hi)

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """``"32"`` or ``"fixed:32"``, ``"uniform:16-64"``, ``"lognormal:32,0.5"`` (mean, sigma)."""
        text = spec.strip()
        kind, _, arg = text.partition(":") if ":" in text else ("fixed", "", text)
        try:
            if kind == "fixed":
                n = int(arg)
                return cls(kind="fixed", mean=n, lo=1, hi=max(n, 1))
            if kind == "uniform":
                lo, hi = (int(x) for x in arg.split("-"))
                return cls(kind="uniform", mean=(lo + hi) // 2, lo=lo, hi=hi)
            if kind == "lognormal":
                m, s = arg.split(",")
                mean = int(m)
                return cls(kind="lognormal", mean=mean, sigma=float(s), hi=max(mean * 8, 1))
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"length spec {spec!r}: expected N, fixed:N, uniform:LO-HI or lognormal:MEAN,SIGMA"
                f" ({e})"
            ) from None
        raise ValueError(f"length spec {spec!r}: kind {kind!r} not in {LENGTH_KINDS}")

    @property
    def max_tokens(self) -> int:
        """The largest count it can draw."""
        return self.mean if self.kind == "fixed" else self.hi

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` counts at once (the simulator's draws)."""
        if self.kind == "fixed":
            x = np.full(n, float(self.mean))
        elif self.kind == "uniform":
            x = rng.uniform(self.lo, self.hi + 1, size=n)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2
            x = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.floor(x), self.lo, self.hi).astype(np.int64)  # [n]

    def sample_one(self, rng: random.Random) -> int:
        """One count (the load generator's draws, interleaved with its other uses of ``rng``)."""
        if self.kind == "fixed":
            n = self.mean
        elif self.kind == "uniform":
            n = rng.randint(self.lo, self.hi)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2  # the median exp(mu) gives this mean
            n = round(rng.lognormvariate(mu, self.sigma))
        return max(self.lo, min(self.hi, n))


@dataclass(frozen=True, kw_only=True)
class ClosedLoop:
    """A closed-loop load, as the canary's load generator drives a deployment: one client
    per admission slot, each sending its next request as soon as its last one finished.
    Between a request's last token and the next request of its client at the engine lies
    the serving path: ``gap_s`` outside the TTFT's clock (the stream back, the client),
    then the front door (where slotune's TTFT starts), then ``path_s`` of work per request
    on average (exponential) on a path that takes one request at a time, first come first
    served (Serve's proxy and router, on the same cores as the engine): requests queue there
    when it is busy, and that queueing is part of the TTFT, as it is live."""

    gap_s: float = 0.0
    path_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gap_s", "path_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name}={v!r}: must be a finite number of seconds >= 0")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Open-loop load: Poisson at ``rate_rps``, or ``trace`` arrival offsets (seconds,
    sorted) replayed cyclically when ``rate_rps`` is None; or, with ``closed`` (and neither
    a rate nor a trace), a closed loop of one client per admission slot."""

    rate_rps: float | None = 10.0
    prompt: LengthDist = LengthDist.lognormal(mean=256, cv=0.5, lo=8, hi=2048)
    output: LengthDist = LengthDist.lognormal(mean=128, cv=0.5, lo=2, hi=1024)
    trace: tuple[float, ...] | None = None
    closed: ClosedLoop | None = None

    def __post_init__(self) -> None:
        if self.closed is not None:
            if self.rate_rps is not None or self.trace is not None:
                raise ValueError(
                    f"rate_rps={self.rate_rps!r}, trace given: {self.trace is not None}: a "
                    "closed loop has neither (its clients send as their requests finish)"
                )
        elif self.trace is None:
            if self.rate_rps is None or not (math.isfinite(self.rate_rps) and self.rate_rps > 0):
                raise ValueError(f"rate_rps={self.rate_rps!r}: must be > 0 (or give a trace)")
        else:
            t = self.trace
            if len(t) < 2 or any(b < a for a, b in zip(t, t[1:], strict=False)) or t[0] < 0:
                raise ValueError("trace: need >= 2 sorted, non-negative arrival offsets")

    @classmethod
    def preset(cls, name: str, *, rate_rps: float) -> Workload:
        presets = {
            "chat": cls(rate_rps=rate_rps),
            "short": cls(
                rate_rps=rate_rps,
                prompt=LengthDist.lognormal(mean=128, cv=0.5, lo=8, hi=1024),
                output=LengthDist.lognormal(mean=64, cv=0.5, lo=2, hi=512),
            ),
            "fixed": cls(
                rate_rps=rate_rps,
                prompt=LengthDist(kind="fixed", mean=128),
                output=LengthDist(kind="fixed", mean=64),
            ),
        }
        if name not in presets:
            raise ValueError(f"workload preset {name!r}: choose one of {sorted(presets)}")
        return presets[name]

    def with_rate(self, rate_rps: float) -> Workload:
        return Workload(rate_rps=rate_rps, prompt=self.prompt, output=self.output)

    def arrivals(self, rng: np.random.Generator, until_s: float) -> np.ndarray:
        """Sorted arrival times in [0, until_s) (an open load's: not for a closed loop)."""
        if self.closed is not None:
            raise ValueError("a closed loop has no arrival times drawn ahead (see ClosedLoop)")
        if self.trace is not None and self.rate_rps is None:
            period = self.trace[-1] + (self.trace[-1] - self.trace[0]) / (len(self.trace) - 1)
            base = np.asarray(self.trace, dtype=np.float64)  # [m]
            reps = int(math.ceil(until_s / period)) + 1
            t = (base[None, :] + period * np.arange(reps)[:, None]).ravel()  # [reps*m]
            return t[t < until_s]
        assert self.rate_rps is not None
        n = int(self.rate_rps * until_s * 1.2 + 10 * math.sqrt(self.rate_rps * until_s) + 10)
        gaps = rng.exponential(1.0 / self.rate_rps, size=n)  # [n]
        t = np.cumsum(gaps)
        while t[-1] < until_s:  # vanishingly rare
            t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1 / self.rate_rps, n))])
        return t[t < until_s]

    def lengths(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_len [n], output_len [n])."""
        return self.prompt.sample(rng, n), self.output.sample(rng, n)


def mean_tokens(dist: LengthDist) -> float:
    """Expected value of the clipped distribution (estimated on a fixed sample)."""
    if dist.kind == "fixed":
        return float(dist.mean)
    return float(dist.sample(np.random.default_rng(0), 20000).mean())


def as_trace(offsets: Sequence[float]) -> tuple[float, ...]:
    return tuple(float(x) for x in offsets)
