"""What the exported curve says: :class:`CurveReport`.

A report holds the measured trials (one :class:`~controller.report.records.TrialRecord`
each), the roofline's predicted curve, the SLO, the hardware and model, and the price;
the chosen operating point is the tuner's incumbent (:attr:`CurveReport.chosen`: the
declared knob with the most pooled goodput, never one whose pooled SLO verdict is not
MET). ``controller.report.files.write_report`` writes it out; ``slotune export`` rebuilds
it from :meth:`CurveReport.from_dict`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from controller.report.cost import million_token_cost
from controller.report.records import PredictedPoint, TrialRecord, json_num, ms_of
from metrics.observation import Slo

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CurveReport:
    """Everything the exported files say."""

    slo: Slo
    trials: tuple[TrialRecord, ...]
    predicted: tuple[PredictedPoint, ...] = ()
    model: str = ""
    hardware: str = ""
    hardware_detail: Mapping[str, Any] = field(default_factory=dict)
    usd_per_hour: float | None = None
    knee_batch: int | None = None
    ridge_flops_per_byte: float | None = None
    predicted_batch: int | None = None  # the roofline's operating point (the seed)
    # How the search was seeded ("" before issue 18's reports): the roofline it came from,
    # or why it ran unseeded (no model config, no hardware).
    seed_note: str = ""
    # How knobs reached the deployment and how its curve was read: actuator, metrics
    # profile, whether the knobs were applied or are only recommended, restart costs.
    backend: Mapping[str, Any] = field(default_factory=dict)
    confirmations: int = 2  # windows a knob needs to be declared (the tuner's stop rule)
    stop_reason: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)  # command, started, wall_s, target
    # The TPOT model the tuner was given, by batch (controller.tune_plan.SearchPlan.model_curve:
    # the served-step model when calibrated); empty: the roofline's ``predicted`` curve.
    model_curve: tuple[PredictedPoint, ...] = ()

    @property
    def chosen(self) -> TrialRecord | None:
        """The operating point, by the tuner's own rule (one rule for both, so a run never
        stops on a knob the report would not deploy): among the knobs *declared* —
        measured in at least ``confirmations`` windows whose SLO verdicts, judged on the
        union of their requests, are both MET — the largest batch whose pooled goodput is
        within ``search.stop_rule.LARGER_BATCH_WITHIN`` of the most
        (``search.stop_rule.incumbent``). When no knob is declared yet (the budget ran out
        first), the best knob whose pooled windows met the SLO, marked unconfirmed in
        :meth:`operating_point`. Never a knob whose pooled verdict is not MET. Its latest
        measurement is returned."""
        p = self._incumbent()
        if p is None:
            return None
        return max(self.measurements_of(p.knobs), key=lambda t: t.number)

    def _points(self) -> list[Any]:
        """One ``search.stop_rule.PointSummary`` per knob, judged as the tuner judges them
        (``search.points.summarize_all``: pooled windows, neighbours' requests, noise)."""
        from search.points import summarize_all
        from search.space import Knobs

        groups: dict[Any, list[tuple[dict[str, Any], float, int]]] = {}
        for t in self.searched:
            k = Knobs(max_batch_size=t.max_batch_size, max_concurrency=t.max_concurrency)
            value = t.goodput_rps if math.isfinite(t.goodput_rps) else 0.0
            groups.setdefault(k, []).append((t.window_attrs(), value, t.number))
        return summarize_all(groups, slo=self.slo)

    def undecided(self) -> Any | None:
        """With no point to deploy: the best candidate no verdict has ruled out (its pooled
        verdicts not VIOLATED; the most goodput, then the earliest), a
        ``search.stop_rule.PointSummary`` with its evidence; None when every knob measured
        was VIOLATED (or nothing was measured): then none is feasible."""
        if self._incumbent() is not None:
            return None
        from metrics.observation import Verdict

        def open_(p: Any) -> bool:
            if p.pooled is not None:
                return p.pooled is not Verdict.VIOLATED
            # no request counts (an old study): open while its p99s are within the SLO
            return p.ttft_p99_s <= self.slo.ttft_p99_s and p.tpot_p99_s <= self.slo.tpot_p99_s

        cands = [p for p in self._points() if open_(p)]
        return max(cands, key=lambda p: (p.goodput_rps, -p.first_trial), default=None)

    def _incumbent(self) -> Any | None:
        from search.stop_rule import incumbent

        points = self._points()
        return incumbent(points, confirmations=self.confirmations) or incumbent(
            points, confirmations=1
        )

    @property
    def searched(self) -> tuple[TrialRecord, ...]:
        """The tuner's own trials: the operating point is chosen among these alone (a
        sweep's or production's windows are drawn beside them, not searched)."""
        return tuple(t for t in self.trials if t.role == "search")

    def measurements_of(self, t: Any) -> list[TrialRecord]:
        """Every search trial of the same knobs as ``t`` (a trial record or knobs)."""
        k = (t.max_batch_size, t.max_concurrency)
        return [x for x in self.searched if (x.max_batch_size, x.max_concurrency) == k]

    def predicted_at(self, batch: int) -> PredictedPoint | None:
        """The roofline's predicted point at ``batch`` (linear interpolation between curve
        points)."""
        return point_at(self.predicted, batch)

    def predicted_tpot_s(self, t: TrialRecord) -> float:
        """The p99 TPOT the tuner's model predicted for trial ``t``: recorded with the
        trial, else read off :attr:`model_curve` (the roofline's curve when empty) at its
        batch limit; NaN when the run was unseeded."""
        if math.isfinite(t.predicted_tpot_s):
            return t.predicted_tpot_s
        p = point_at(self.model_curve or self.predicted, t.max_batch_size)
        return p.tpot_s if p is not None else math.nan

    def roofline_fraction(self, t: TrialRecord) -> float:
        """Measured tokens/s ÷ the roofline's tokens/s at the batch that could run."""
        p = self.predicted_at(min(t.max_batch_size, t.max_concurrency))
        if p is None or not (p.tokens_per_s > 0) or not math.isfinite(t.tokens_per_s):
            return math.nan
        return t.tokens_per_s / p.tokens_per_s

    def operating_point(self) -> dict[str, Any] | None:
        p = self._incumbent()
        if p is None:
            return None
        same = self.measurements_of(p.knobs)
        c = max(same, key=lambda t: t.number)
        return {
            "max_batch_size": c.max_batch_size,
            "max_concurrency": c.max_concurrency,
            "goodput_rps": c.goodput_rps,
            "tokens_per_s": c.tokens_per_s,
            "p99_ttft_ms": c.p99_ttft_ms,
            "p99_tpot_ms": c.p99_tpot_ms,
            "usd_per_million_tokens": million_token_cost(self.usd_per_hour, c.tokens_per_s),
            # what each $1/h of device price costs per million tokens (scale by your price)
            "usd_per_million_tokens_per_usd_hour": million_token_cost(1.0, c.tokens_per_s),
            # the verdict the point was chosen on: every window of these knobs pooled (a
            # latest window too short for a p99 of its own lends its requests to the rest)
            "verdict": (p.pooled.value if p.pooled is not None else "met"),
            "latest_window_verdict": c.verdict,
            "trial": c.number,
            "ttft_samples": c.ttft_samples,
            "tpot_samples": c.tpot_samples,
            "roofline_fraction": self.roofline_fraction(c),
            "measurements": len(same),
            "met_windows": sum(t.feasible for t in same),
            # declared on `confirmations` windows, as the tuner's stop rule requires
            "confirmed": p.declared(self.confirmations),
            "mean_goodput_rps": p.goodput_rps,  # pooled: SLO-meeting requests / window time
        }

    def sample_hint(self) -> str:
        """When most trials could not reach a verdict for lack of requests, what to do."""
        ins = [
            t
            for t in self.searched
            if "insufficient" in (t.ttft_verdict, t.tpot_verdict)
            and "violated"
            not in (
                t.ttft_verdict,
                t.tpot_verdict,
            )
        ]
        if not self.searched or len(ins) * 2 < len(self.searched):
            return ""
        most = max(t.completed for t in ins)
        need = math.ceil(math.log(1 - 0.95) / math.log(self.slo.quantile))
        return (
            f"{len(ins)} of {len(self.searched)} windows were too small to judge a "
            f"p{self.slo.quantile * 100:g} (at most {most} requests; a verdict at 95% "
            f"confidence needs at least {need} with none over the SLO): lengthen the window "
            "(--max-window), shorten the requests (--output-tokens) or add capacity."
        )

    def cross_check(self) -> dict[str, Any]:
        """How far the client's p99s are from the server's: the median over trials of
        client / server - 1 (positive: the client saw slower), and the trial count."""

        def med(pairs: list[tuple[float, float]]) -> float | None:
            r = sorted(c / s - 1 for c, s in pairs if math.isfinite(c) and math.isfinite(s) and s)
            if not r:
                return None
            mid = len(r) // 2
            return r[mid] if len(r) % 2 else (r[mid - 1] + r[mid]) / 2

        tpot = [(t.client_p99_tpot_ms, t.p99_tpot_ms) for t in self.trials]
        ttft = [(t.client_p99_ttft_ms, t.p99_ttft_ms) for t in self.trials]
        return {
            "trials": sum(t.client_completed > 0 for t in self.trials),
            "median_p99_tpot_rel_diff": med(tpot),
            "median_p99_ttft_rel_diff": med(ttft),
        }

    def slo_cut_predicted(self) -> PredictedPoint | None:
        """The largest predicted batch whose TPOT meets the SLO (where the SLO cuts the curve)."""
        ok = [p for p in self.predicted if p.tpot_s <= self.slo.tpot_p99_s]
        return max(ok, key=lambda p: p.batch) if ok else None

    def to_dict(self) -> dict[str, Any]:
        cut = self.slo_cut_predicted()
        return json_num(
            {
                "slo": {
                    "ttft_p99_ms": ms_of(self.slo.ttft_p99_s),
                    "tpot_p99_ms": ms_of(self.slo.tpot_p99_s),
                    "quantile": self.slo.quantile,
                },
                "operating_point": self.operating_point(),
                "model": self.model,
                "hardware": self.hardware,
                "hardware_detail": dict(self.hardware_detail),
                "usd_per_hour": self.usd_per_hour,
                "knee_batch": self.knee_batch,
                "ridge_flops_per_byte": self.ridge_flops_per_byte,
                "predicted_batch": self.predicted_batch,
                "seed_note": self.seed_note,
                "backend": dict(self.backend),
                "confirmations": self.confirmations,
                "predicted_slo_cut_batch": cut.batch if cut else None,
                "client_cross_check": self.cross_check(),
                "stop_reason": self.stop_reason,
                "meta": dict(self.meta),
                "trials": [
                    {
                        **t.to_dict(),
                        "predicted_p99_tpot_ms": ms_of(self.predicted_tpot_s(t)),
                        "roofline_fraction": self.roofline_fraction(t),
                    }
                    for t in self.trials
                ],
                "predicted": [asdict(p) for p in self.predicted],
                "model_curve": [asdict(p) for p in self.model_curve],
            }
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CurveReport:
        s = d["slo"]
        return cls(
            slo=Slo(
                ttft_p99_s=float(s["ttft_p99_ms"]) / 1e3,
                tpot_p99_s=float(s["tpot_p99_ms"]) / 1e3,
                quantile=float(s.get("quantile", 0.99)),
            ),
            trials=tuple(TrialRecord.from_dict(t) for t in d.get("trials", [])),
            predicted=tuple(PredictedPoint.of(p) for p in d.get("predicted", [])),
            model=d.get("model", ""),
            hardware=d.get("hardware", ""),
            hardware_detail=d.get("hardware_detail") or {},
            usd_per_hour=d.get("usd_per_hour"),
            knee_batch=d.get("knee_batch"),
            ridge_flops_per_byte=d.get("ridge_flops_per_byte"),
            predicted_batch=d.get("predicted_batch"),
            seed_note=d.get("seed_note", ""),
            backend=d.get("backend") or {},
            confirmations=int(d.get("confirmations") or 2),
            stop_reason=d.get("stop_reason", ""),
            meta=d.get("meta") or {},
            model_curve=tuple(PredictedPoint.of(p) for p in d.get("model_curve") or []),
        )

    def with_trials(self, trials: Sequence[TrialRecord], **kw: Any) -> CurveReport:
        return replace(self, trials=tuple(trials), **kw)


def point_at(curve: Sequence[PredictedPoint], batch: int) -> PredictedPoint | None:
    """The point of ``curve`` at ``batch``, linearly interpolated in TPOT between its points;
    None outside the curve."""
    pts = sorted(curve, key=lambda p: p.batch)
    if not pts or batch < pts[0].batch or batch > pts[-1].batch:
        return None
    for a, b in zip(pts, pts[1:] or pts, strict=False):
        if a.batch == batch:
            return a
        if a.batch < batch <= b.batch:
            w = (batch - a.batch) / (b.batch - a.batch)
            tpot = a.tpot_s + w * (b.tpot_s - a.tpot_s)
            return PredictedPoint(batch=batch, tpot_s=tpot, tokens_per_s=batch / tpot)
    return pts[-1] if pts[-1].batch == batch else None
