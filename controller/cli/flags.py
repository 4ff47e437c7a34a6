"""Flags several commands share, read and checked one way."""

from __future__ import annotations

import math

from controller.errors import BadInput
from metrics.observation import Slo


def slo_from_ms(slo_ttft_ms: float, slo_tpot_ms: float) -> Slo:
    """The SLO of ``--slo-ttft-ms`` and ``--slo-tpot-ms``; BadInput naming a bad value."""
    for flag, ms in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        if not (math.isfinite(ms) and ms > 0):
            raise BadInput(f"{flag} {ms:g}: must be a positive number of ms")
    return Slo(ttft_p99_s=slo_ttft_ms / 1e3, tpot_p99_s=slo_tpot_ms / 1e3)
