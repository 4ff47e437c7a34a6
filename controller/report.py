"""The exported curve: ``curve.csv``, ``curve.json``, ``curve.png`` and ``report.html``.

Input is a :class:`CurveReport`: the measured trials (one :class:`TrialRecord`
each), the roofline's predicted curve, the SLO, the hardware and model, and the
price; the chosen operating point is the feasible trial with the most goodput
(never an infeasible one). :func:`write_report` writes all four files;
``slotune export`` rebuilds the same files from :meth:`CurveReport.from_dict`.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from metrics.observation import Observation, Slo, Verdict

log = logging.getLogger(__name__)

FILES = ("curve.csv", "curve.json", "curve.png", "report.html")


def _ms(seconds: float) -> float:
    return seconds * 1e3 if math.isfinite(seconds) else math.nan


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def usd_per_million_tokens(usd_per_hour: float | None, tokens_per_s: float) -> float:
    """Cost of a million output tokens at a device price: $/h ÷ (tokens/s · 3600) · 1e6."""
    if usd_per_hour is None or not (tokens_per_s > 0) or not math.isfinite(tokens_per_s):
        return math.nan
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One measured trial, flat (one CSV row; one JSONL line)."""

    number: int
    max_batch_size: int
    max_concurrency: int
    tokens_per_s: float
    goodput_rps: float
    throughput_rps: float
    completed: int
    rejected: int
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    ttft_verdict: str  # met | violated | insufficient | none
    tpot_verdict: str
    ttft_samples: int
    tpot_samples: int
    feasible: bool
    window_s: float
    wall_s: float = math.nan  # the whole trial: apply, warm-up, window
    source: str = ""
    # The load generator's own view of the same window (cross-check; NaN when absent).
    client_completed: int = 0
    client_p99_ttft_ms: float = math.nan
    client_p99_tpot_ms: float = math.nan
    client_rejected: int = 0
    client_errors: int = 0
    note: str = ""  # why not feasible, or what went wrong

    @classmethod
    def from_observation(
        cls,
        *,
        number: int,
        knobs: Any,
        obs: Observation,
        feasible: bool,
        wall_s: float = math.nan,
        client: Observation | None = None,
        client_errors: int = 0,
        note: str = "",
    ) -> TrialRecord:
        def verdict(v: Any) -> tuple[str, int]:
            return ("none", 0) if v is None else (Verdict(v.verdict).value, int(v.samples))

        tv, tn = verdict(obs.ttft_verdict)
        pv, pn = verdict(obs.tpot_verdict)
        return cls(
            number=number,
            max_batch_size=int(knobs.max_batch_size),
            max_concurrency=int(knobs.max_concurrency),
            tokens_per_s=float(obs.tokens_per_s),
            goodput_rps=float(obs.goodput_rps),
            throughput_rps=float(obs.throughput_rps),
            completed=int(obs.completed),
            rejected=int(obs.rejected),
            p50_ttft_ms=_ms(obs.ttft.p50),
            p99_ttft_ms=_ms(obs.ttft.p99),
            p50_tpot_ms=_ms(obs.tpot.p50),
            p99_tpot_ms=_ms(obs.tpot.p99),
            ttft_verdict=tv,
            tpot_verdict=pv,
            ttft_samples=tn,
            tpot_samples=pn,
            feasible=bool(feasible),
            window_s=float(obs.window_s),
            wall_s=float(wall_s),
            source=obs.source,
            client_completed=int(client.completed) if client else 0,
            client_p99_ttft_ms=_ms(client.ttft.p99) if client else math.nan,
            client_p99_tpot_ms=_ms(client.tpot.p99) if client else math.nan,
            client_rejected=int(client.rejected) if client else 0,
            client_errors=int(client_errors),
            note=note,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_num(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrialRecord:
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            v = d[f.name]
            if f.type in ("float",) and v is None:
                v = math.nan
            kw[f.name] = v
        return cls(**kw)

    @property
    def verdict(self) -> str:
        if self.feasible:
            return "met"
        if "violated" in (self.ttft_verdict, self.tpot_verdict):
            return "violated"
        return "insufficient"


@dataclass(frozen=True, kw_only=True)
class PredictedPoint:
    """One point of the roofline's predicted curve."""

    batch: int
    tpot_s: float
    tokens_per_s: float
    bound: str = ""  # "memory" | "compute"

    @classmethod
    def of(cls, p: Any) -> PredictedPoint:
        """From a ``search.roofline.CurvePoint`` (or any object or dict with these fields)."""
        get = p.get if isinstance(p, Mapping) else lambda k, d=None: getattr(p, k, d)
        return cls(
            batch=int(get("batch")),
            tpot_s=float(get("tpot_s")),
            tokens_per_s=float(get("tokens_per_s")),
            bound=str(get("bound", "") or ""),
        )


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
    stop_reason: str = ""
    meta: Mapping[str, Any] = field(default_factory=dict)  # command, started, wall_s, target

    @property
    def chosen(self) -> TrialRecord | None:
        """The operating point: among knobs whose every measurement met the SLO, the one with
        the most mean goodput (ties: the earliest measured); its latest measurement is shown.
        The same rule as the tuner's incumbent (``search.stop_rule.incumbent``)."""
        groups: dict[tuple[int, int], list[TrialRecord]] = {}
        for t in self.trials:
            groups.setdefault((t.max_batch_size, t.max_concurrency), []).append(t)
        best: tuple[float, int] | None = None
        pick: TrialRecord | None = None
        for ts in groups.values():
            if not all(t.feasible and math.isfinite(t.goodput_rps) for t in ts):
                continue
            key = (sum(t.goodput_rps for t in ts) / len(ts), -min(t.number for t in ts))
            if best is None or key > best:
                best, pick = key, max(ts, key=lambda t: t.number)
        return pick

    def measurements_of(self, t: TrialRecord) -> list[TrialRecord]:
        """Every trial of the same knobs as ``t``."""
        k = (t.max_batch_size, t.max_concurrency)
        return [x for x in self.trials if (x.max_batch_size, x.max_concurrency) == k]

    def predicted_at(self, batch: int) -> PredictedPoint | None:
        """The predicted point at ``batch`` (linear interpolation between curve points)."""
        pts = sorted(self.predicted, key=lambda p: p.batch)
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

    def roofline_fraction(self, t: TrialRecord) -> float:
        """Measured tokens/s ÷ the roofline's tokens/s at the batch that could run."""
        p = self.predicted_at(min(t.max_batch_size, t.max_concurrency))
        if p is None or not (p.tokens_per_s > 0) or not math.isfinite(t.tokens_per_s):
            return math.nan
        return t.tokens_per_s / p.tokens_per_s

    def operating_point(self) -> dict[str, Any] | None:
        c = self.chosen
        if c is None:
            return None
        same = self.measurements_of(c)
        return {
            "max_batch_size": c.max_batch_size,
            "max_concurrency": c.max_concurrency,
            "goodput_rps": c.goodput_rps,
            "tokens_per_s": c.tokens_per_s,
            "p99_ttft_ms": c.p99_ttft_ms,
            "p99_tpot_ms": c.p99_tpot_ms,
            "usd_per_million_tokens": usd_per_million_tokens(self.usd_per_hour, c.tokens_per_s),
            "verdict": c.verdict,
            "trial": c.number,
            "ttft_samples": c.ttft_samples,
            "tpot_samples": c.tpot_samples,
            "roofline_fraction": self.roofline_fraction(c),
            "measurements": len(same),
            "mean_goodput_rps": sum(t.goodput_rps for t in same) / len(same),
        }

    def slo_cut_predicted(self) -> PredictedPoint | None:
        """The largest predicted batch whose TPOT meets the SLO (where the SLO cuts the curve)."""
        ok = [p for p in self.predicted if p.tpot_s <= self.slo.tpot_p99_s]
        return max(ok, key=lambda p: p.batch) if ok else None

    def to_dict(self) -> dict[str, Any]:
        cut = self.slo_cut_predicted()
        return _json_num(
            {
                "slo": {
                    "ttft_p99_ms": _ms(self.slo.ttft_p99_s),
                    "tpot_p99_ms": _ms(self.slo.tpot_p99_s),
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
                "predicted_slo_cut_batch": cut.batch if cut else None,
                "stop_reason": self.stop_reason,
                "meta": dict(self.meta),
                "trials": [
                    {**t.to_dict(), "roofline_fraction": self.roofline_fraction(t)}
                    for t in self.trials
                ],
                "predicted": [asdict(p) for p in self.predicted],
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
            stop_reason=d.get("stop_reason", ""),
            meta=d.get("meta") or {},
        )

    def with_trials(self, trials: Sequence[TrialRecord], **kw: Any) -> CurveReport:
        return replace(self, trials=tuple(trials), **kw)


def _json_num(x: Any) -> Any:
    """NaN/inf → None, recursively (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_num(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_num(v) for v in x]
    return x


CSV_COLUMNS = [f.name for f in fields(TrialRecord)] + ["roofline_fraction"]


def write_csv(report: CurveReport, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for t in report.trials:
            row = {**asdict(t), "roofline_fraction": report.roofline_fraction(t)}
            w.writerow(
                {k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
            )


def plot_png(report: CurveReport) -> bytes:
    """tokens/s against p99 TPOT: measured trials, the predicted curve, knee, SLO, the choice."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.6), dpi=110)
    try:
        pred = sorted(report.predicted, key=lambda p: p.batch)
        if pred:
            ax.plot(
                [_ms(p.tpot_s) for p in pred],
                [p.tokens_per_s for p in pred],
                "-",
                color="#7a7a7a",
                lw=1.6,
                label="roofline prediction",
            )
            for p in pred[:: max(1, len(pred) // 8)]:
                ax.annotate(
                    f"B={p.batch}",
                    (_ms(p.tpot_s), p.tokens_per_s),
                    fontsize=7,
                    color="#7a7a7a",
                    xytext=(3, -10),
                    textcoords="offset points",
                )
        knee = report.predicted_at(report.knee_batch) if report.knee_batch else None
        if knee is not None:
            ax.plot([_ms(knee.tpot_s)], [knee.tokens_per_s], "D", color="#555", ms=8)
            ax.annotate(
                f"knee B≈{report.knee_batch}"
                + (
                    f"\nridge {report.ridge_flops_per_byte:.0f} FLOP/B"
                    if report.ridge_flops_per_byte
                    else ""
                ),
                (_ms(knee.tpot_s), knee.tokens_per_s),
                fontsize=8,
                xytext=(8, 8),
                textcoords="offset points",
            )
        for feasible, color, label in (
            (True, "#1a9850", "measured, meets SLO"),
            (False, "#d73027", "measured, misses SLO"),
        ):
            pts = [
                t
                for t in report.trials
                if t.feasible is feasible and math.isfinite(t.p99_tpot_ms) and t.tokens_per_s > 0
            ]
            if pts:
                ax.scatter(
                    [t.p99_tpot_ms for t in pts],
                    [t.tokens_per_s for t in pts],
                    s=36,
                    color=color,
                    edgecolor="black",
                    linewidths=0.4,
                    zorder=3,
                    label=label,
                )
                for t in pts:
                    ax.annotate(
                        f"{t.max_batch_size}/{t.max_concurrency}",
                        (t.p99_tpot_ms, t.tokens_per_s),
                        fontsize=7,
                        color=color,
                        xytext=(5, 4),
                        textcoords="offset points",
                    )
        ax.axvline(
            _ms(report.slo.tpot_p99_s),
            color="#2166ac",
            ls="--",
            lw=1.2,
            label=f"p99 TPOT SLO {_ms(report.slo.tpot_p99_s):.0f} ms",
        )
        op = report.operating_point()
        if op is not None:
            cost = op["usd_per_million_tokens"]
            text = f"chosen B={op['max_batch_size']}, C={op['max_concurrency']}\n"
            text += f"{op['tokens_per_s']:.0f} tok/s, {op['goodput_rps']:.2f} req/s"
            if math.isfinite(cost):
                text += f"\n${cost:.3g} per 1M tokens"
            ax.scatter(
                [op["p99_tpot_ms"]],
                [op["tokens_per_s"]],
                s=220,
                facecolors="none",
                edgecolors="#2166ac",
                linewidths=2,
                zorder=4,
            )
            ax.annotate(
                text,
                (op["p99_tpot_ms"], op["tokens_per_s"]),
                fontsize=9,
                xytext=(-150, 18),
                textcoords="offset points",
                arrowprops={"arrowstyle": "->", "color": "#2166ac"},
                bbox={"boxstyle": "round", "fc": "white", "ec": "#2166ac"},
            )
        ax.set_xlabel("p99 TPOT (ms per output token); measured points labelled batch/concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(
            f"{report.model or 'model'} on {report.hardware or 'device'}: "
            "throughput against latency"
        )
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def write_report(report: CurveReport, out_dir: str | Path) -> dict[str, Path]:
    """Write the four files into ``out_dir`` (created); returns their paths by name."""
    from controller.report_html import render_html

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    write_csv(report, paths["curve.csv"])
    paths["curve.json"].write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n")
    png = plot_png(report)
    paths["curve.png"].write_bytes(png)
    html = render_html(report, png_b64=base64.b64encode(png).decode("ascii"))
    paths["report.html"].write_text(html, encoding="utf-8")
    log.info("report written to %s", out)
    return paths
