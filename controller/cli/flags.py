"""Flags several commands share, read and checked one way (before any work is done)."""

from __future__ import annotations

import math
from urllib.parse import urlsplit

from controller.errors import BadInput
from metrics.observation import Slo

MAX_SEED = 2**32 - 1  # numpy's and Optuna's samplers take seeds in [0, 2**32)


def slo_from_ms(slo_ttft_ms: float, slo_tpot_ms: float) -> Slo:
    """The SLO of ``--slo-ttft-ms`` and ``--slo-tpot-ms``; BadInput naming a bad value."""
    for flag, ms in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
        positive_ms(flag, ms)
    return Slo(ttft_p99_s=slo_ttft_ms / 1e3, tpot_p99_s=slo_tpot_ms / 1e3)


def positive_ms(flag: str, ms: float) -> None:
    if not (math.isfinite(ms) and ms > 0):
        raise BadInput(f"{flag} {ms:g}: must be a positive number of ms")


def price(flag: str, usd: float | None) -> None:
    """A price per device-hour: None (not given) or a finite number >= 0."""
    if usd is not None and not (math.isfinite(usd) and usd >= 0):
        raise BadInput(f"{flag} {usd:g}: must be a number >= 0")


def seed(flag: str, value: int) -> None:
    if not 0 <= value <= MAX_SEED:
        raise BadInput(f"{flag} {value}: must be an integer in [0, {MAX_SEED}]")


def at_least(flag: str, value: int | None, least: int) -> None:
    """An integer flag that must be >= ``least`` (None: not given, allowed)."""
    if value is not None and value < least:
        raise BadInput(f"{flag} {value}: must be an integer >= {least}")


def http_url(flag: str, url: str | None) -> None:
    """An http(s) URL with a host (and a valid port, if any); None: not given."""
    if url is None:
        return
    parts = urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise BadInput(f"{flag} {url}: must be an http:// or https:// URL with a host[:port]")
