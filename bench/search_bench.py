"""The simulated scenarios bench/search_efficiency.py measures strategies on: cached
noisy windows shared by all strategies (common random numbers), the long noise-free
truth of a knob, the oracle, and the fixed grids the grid baselines sweep. See
bench/search_efficiency.py for what each means."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

from controller.sim.scenarios import resolve_scenario
from controller.sim.target import SimTarget
from metrics.observation import Observation
from search.space import Knobs

STRATEGIES = ("slotune", "gp-unseeded", "tpe", "random", "grid", "grid-band")
# slotune's row scored by the baselines' incumbent (see run_strategy's ``single``)
SINGLE_SUFFIX = "-1w"
GRIDS = ("grid", "grid-band")
HEADROOMS = (1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0)
TOLERANCE = 0.05
TRUTH_WINDOW_SCALE = 8.0


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:6], "little")


@dataclass
class Truth:
    goodput: float
    feasible: bool
    ttft_p99: float
    tpot_p99: float


class Bench:
    """One scenario: cached noisy windows, cached truths, the oracle."""

    def __init__(
        self,
        name: str,
        replicates: int,
        *,
        sequential: bool = True,
        window_noise_cv: float | None = None,
    ) -> None:
        """``sequential``: windows stop once decided (False: the ablation, whole windows);
        ``window_noise_cv``: the per-window slowdown's CV instead of the scenario's."""
        self.name = name
        sc = resolve_scenario(name)
        if window_noise_cv is not None:
            sc = replace(sc, window_noise_cv=window_noise_cv)
        self.target = SimTarget(sc, sequential=sequential)
        self.slo = self.target.slo
        self.replicates = replicates
        self._windows: dict[tuple[int, int, int], Observation] = {}
        self._truth: dict[Knobs, Truth] = {}
        self.sim_windows = 0
        self.truth_windows = 0
        self.lookups = 0

    def measure(self, knobs: Knobs, *, seed: int, nth: int) -> Observation:
        self.lookups += 1
        # Distinct windows for the first `replicates` measurements of a knob in a seed.
        base = _h(self.name, seed, knobs.max_batch_size, knobs.max_concurrency)
        r = (base + nth) % self.replicates
        key = (knobs.max_batch_size, knobs.max_concurrency, r)
        if key not in self._windows:
            self.sim_windows += 1
            sim_seed = _h(self.name, "window", *key) % (2**31)
            self._windows[key] = self.target.run(knobs, seed=sim_seed).observation
        return self._windows[key]

    def truth(self, knobs: Knobs) -> Truth:
        if knobs not in self._truth:
            self.truth_windows += 1
            o = self.target.run(
                knobs,
                seed=_h(self.name, "truth") % 2**31,
                denoised=True,
                window_scale=TRUTH_WINDOW_SCALE,
                whole=True,
            ).observation
            # The long, noise-free run's p99s within the SLO (on fresh, non-empty data).
            ok = (
                o.completed > 0
                and o.ttft.p99 <= self.slo.ttft_p99_s
                and (o.tpot.p99 <= self.slo.tpot_p99_s or math.isnan(o.tpot.p99))
            )
            self._truth[knobs] = Truth(
                goodput=o.goodput_rps, feasible=ok, ttft_p99=o.ttft.p99, tpot_p99=o.tpot.p99
            )
        return self._truth[knobs]

    def oracle(self) -> tuple[Knobs, float]:
        space = self.target.space
        batches: list[int] = []
        b = float(space.batch_min)
        while b <= space.batch_max:
            if not batches or int(b) != batches[-1]:
                batches.append(int(b))
            b = max(b * 1.12, b + 1)
        if batches[-1] != space.batch_max:
            batches.append(space.batch_max)
        best: tuple[float, Knobs] | None = None
        misses = 0
        for bb in batches:  # headroom 1 first; stop 3 lattice steps past the last feasible
            k = Knobs(max_batch_size=bb, max_concurrency=bb)
            t = self.truth(k)
            if t.feasible and (best is None or t.goodput > best[0]):
                best = (t.goodput, k)
            misses = 0 if t.feasible else misses + 1
            if best is not None and misses >= 2:
                break
        if best is None:
            raise RuntimeError(f"{self.name}: no truly feasible point on the oracle grid")
        b0 = best[1].max_batch_size
        lo, hi = max(space.batch_min, int(b0 / 1.06)), min(space.batch_max, int(b0 * 1.12) + 1)
        for bb in range(lo, hi + 1):  # every integer batch around the best
            t = self.truth(Knobs(max_batch_size=bb, max_concurrency=bb))
            if t.feasible and t.goodput > best[0]:
                best = (t.goodput, Knobs(max_batch_size=bb, max_concurrency=bb))
        b0 = best[1].max_batch_size
        for bb in (
            max(space.batch_min, round(b0 / 1.06)),
            b0,
            min(space.batch_max, round(b0 * 1.06)),
        ):
            for h in HEADROOMS[1:]:  # more admission headroom at and next to the best
                k = space.clip(Knobs(max_batch_size=bb, max_concurrency=max(bb, round(bb * h))))
                t = self.truth(k)
                if t.feasible and t.goodput > best[0]:
                    best = (t.goodput, k)
        return best[1], best[0]


def grid_knobs(bench: Bench, kind: str = "grid") -> list[Knobs]:
    """vLLM auto_tune-style fixed lists of powers of two, swept in nested order (batch
    ascending, then concurrency ascending). ``grid``: batch 1, 2, 4, ... up to the space's
    largest batch x concurrency 1, 2, 4, ... up to its largest admission limit, every pair
    with concurrency >= batch. ``grid-band``: concurrency = batch x 1, 2, 4 only (capped by
    the space's headroom)."""
    space = bench.target.space
    bs = [2**i for i in range(space.batch_max.bit_length()) if 2**i >= space.batch_min]
    if kind == "grid-band":
        hs = [h for h in (1.0, 2.0, 4.0) if h <= space.headroom_max]
        return space.grid(batches=bs, headrooms=hs)
    if kind != "grid":
        raise ValueError(f"grid kind {kind!r}: choose one of {GRIDS}")
    c_max = space.concurrency_max or int(space.batch_max * space.headroom_max)
    cs = [2**i for i in range(c_max.bit_length())]
    return [Knobs(max_batch_size=b, max_concurrency=c) for b in bs for c in cs if c >= b]
