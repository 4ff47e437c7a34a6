"""The live progress display of ``slotune tune``: n of N, the trial's number in the
study (as trials.jsonl, the report and optuna-dashboard number it), the knobs, the p99s
against the SLO, goodput and the best so far (rich, on stderr); silent with ``--quiet``."""

from __future__ import annotations

import logging
from typing import Any

from controller.report.records import TrialRecord

log = logging.getLogger(__name__)


class Progress:
    """No display (``--quiet``); subclass hooks are called around each trial."""

    def begin(self, n: int, total: int, knobs: Any) -> None:
        pass

    def end(self, rec: TrialRecord, best: TrialRecord | None, total: int) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class RichProgress(Progress):
    """A live display on stderr: a spinner while a trial runs, one line per trial after."""

    def __init__(self, slo: Any) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        self.slo = slo
        self._status: Any = None
        self._n = 0

    def begin(self, n: int, total: int, knobs: Any) -> None:
        self._n = n
        self._status = self.console.status(
            f"{n}/{total}: applying and measuring batch={knobs.max_batch_size} "
            f"concurrency={knobs.max_concurrency} ..."
        )
        self._status.start()

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def end(self, rec: TrialRecord, best: TrialRecord | None, total: int) -> None:
        self._stop_status()

        def mark(v: str) -> str:
            return {"met": "[green]ok[/]", "violated": "[red]miss[/]"}.get(v, "[yellow]?[/]")

        s = self.slo
        line = (
            f"{self._n:>2}/{total} trial {rec.number:<3} B={rec.max_batch_size:<4} "
            f"C={rec.max_concurrency:<4} "
            f"p99 TTFT {rec.p99_ttft_ms:7.1f}/{s.ttft_p99_s * 1e3:.0f} ms "
            f"{mark(rec.ttft_verdict)}  "
            f"p99 TPOT {rec.p99_tpot_ms:6.1f}/{s.tpot_p99_s * 1e3:.0f} ms "
            f"{mark(rec.tpot_verdict)}  "
            f"goodput {rec.goodput_rps:6.2f} req/s  {rec.tokens_per_s:7.0f} tok/s  "
            f"n={rec.completed}  [{rec.wall_s:.0f} s]"
        )
        if best is not None:
            line += f"  best: B={best.max_batch_size},C={best.max_concurrency}"
        if rec.note:
            line += f"\n      [dim]{rec.note}[/]"
        self.console.print(line, soft_wrap=True)

    def message(self, text: str) -> None:
        self._stop_status()
        self.console.print(text, soft_wrap=True)

    def close(self) -> None:
        self._stop_status()
