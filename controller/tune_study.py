"""A ``slotune tune`` run as its Optuna study stores it, and the report rebuilt from it.

``run_tune`` writes every trial record and the report's context into the study's user
attributes (besides ``trials.jsonl``), so ``slotune export STUDY`` rebuilds the same report
and a resumed run keeps its earlier trials.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from controller.report.curve import CurveReport
from controller.report.records import TrialRecord
from metrics.observation import DEFAULT_SLO, Slo

if TYPE_CHECKING:
    from search.tuner import Tuner

log = logging.getLogger(__name__)

STUDY_META_KEY = "slotune.report"
STUDY_TRIAL_PREFIX = "slotune.trial."
STUDY_SWEEP_PREFIX = "slotune.sweep."  # the curve sweep's windows (not Optuna trials)


def save_to_study(tuner: Tuner, key: str, value: dict[str, Any]) -> None:
    """Store ``value`` under ``key`` in the study of ``tuner``; a storage failure is logged,
    not raised (the run's JSONL still has it)."""
    try:
        tuner.study.set_user_attr(key, value)
    except Exception as e:  # storage trouble must not lose the run; the JSONL has it
        log.warning("could not store %s in the study: %s", key, e)


def stored_records(user_attrs: dict[str, Any]) -> list[TrialRecord]:
    """The records ``run_tune`` stored in a study's user attributes: the trials in trial
    order, then the curve sweeps' windows."""
    return [
        TrialRecord.from_dict(v)
        for prefix in (STUDY_TRIAL_PREFIX, STUDY_SWEEP_PREFIX)
        for k, v in sorted(user_attrs.items())
        if k.startswith(prefix)
    ]


def report_from_study(storage: str, study_name: str | None = None) -> CurveReport:
    """Rebuild the :class:`CurveReport` of a stored study (``slotune export STUDY``).

    Studies written by ``slotune tune`` carry every trial record and the report's
    context in their user attributes; other slotune studies (``slotune simulate``)
    are rebuilt from the tuner's per-trial attributes, with no prediction."""
    import optuna

    from search.tuner import open_storage

    st = open_storage(storage)
    names = optuna.get_all_study_names(st)
    if study_name is None:
        if len(names) != 1:
            raise ValueError(
                f"storage {storage!r} holds studies {names}: name one with --study-name"
            )
        study_name = names[0]
    if study_name not in names:
        raise ValueError(f"study {study_name!r} not in {storage!r} (it holds {names})")
    study = optuna.load_study(study_name=study_name, storage=st)
    ua = study.user_attrs
    trials = stored_records(ua)
    meta = ua.get(STUDY_META_KEY)
    if meta is not None:
        return CurveReport.from_dict({**meta, "trials": [t.to_dict() for t in trials]})
    # A study of the bare tuner: rebuild what its trial attributes hold.
    slo = _slo_from_trials(study) or DEFAULT_SLO
    recs = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        if "max_batch_size" not in a or t.state.name != "COMPLETE":
            continue
        recs.append(
            TrialRecord(
                number=t.number,
                max_batch_size=int(a["max_batch_size"]),
                max_concurrency=int(a["max_concurrency"]),
                tokens_per_s=_f(a.get("tokens_per_s")),
                goodput_rps=_f(a.get("goodput_rps")),
                throughput_rps=_f(a.get("throughput_rps")),
                completed=int(a.get("completed") or 0),
                rejected=int(a.get("rejected") or 0),
                p50_ttft_ms=_f(a.get("ttft_p50_s")) * 1e3,
                p99_ttft_ms=_f(a.get("ttft_p99_s")) * 1e3,
                p50_tpot_ms=_f(a.get("tpot_p50_s")) * 1e3,
                p99_tpot_ms=_f(a.get("tpot_p99_s")) * 1e3,
                ttft_verdict=str(a.get("ttft_verdict", "none")),
                tpot_verdict=str(a.get("tpot_verdict", "none")),
                ttft_samples=int(a.get("completed") or 0),
                tpot_samples=int(a.get("completed") or 0),
                feasible=bool(a.get("feasible", False)),
                window_s=_f(a.get("window_s")),
                note=str(a.get("reason", "")),
            )
        )
    return CurveReport(slo=slo, trials=tuple(recs), meta={"study": study_name})


def _f(x: Any) -> float:
    return math.nan if x is None else float(x)


def _slo_from_trials(study: Any) -> Slo | None:
    """The SLO a bare tuner study was run under, from its constraints (p99 − SLO)."""
    from search.tuner import CONSTRAINT_NAMES

    # Only a MET verdict's constraint is exactly p99 - SLO (others are floored at > 0).
    for t in study.get_trials(deepcopy=False):
        a, c = t.user_attrs, dict(t.constraints or {})
        if a.get("ttft_verdict") != "met" or a.get("tpot_verdict") != "met":
            continue
        try:
            ttft = a["ttft_p99_s"] - c[CONSTRAINT_NAMES[0]]
            tpot = a["tpot_p99_s"] - c[CONSTRAINT_NAMES[1]]
            return Slo(ttft_p99_s=ttft, tpot_p99_s=tpot)
        except (ValueError, KeyError, TypeError):
            continue
    return None
