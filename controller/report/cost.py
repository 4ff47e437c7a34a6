"""What a million output tokens cost at the operating point, and where the price came from.

cost = (device $/h) / (tokens/s · 3600) · 1e6 (one device). The price is the user's
``--price-per-hour``; without one, a GPU the hardware catalog knows
(``search.roofline.hardware.CATALOG``) gets that entry's indicative on-demand rate, said so
wherever the cost is shown; anything else (a CPU, an unknown GPU) gets no price, and
the report says what one dollar an hour buys so the reader can scale it.
"""

from __future__ import annotations

import logging
import math
import re

from search.roofline.operating_point import usd_per_million_tokens

log = logging.getLogger(__name__)

# torch.cuda.get_device_name() → catalog key; first match wins (PCIe before SXM).
_GPU_NAMES = (
    (r"\bh200\b", "h200"),
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),
    (r"\bh100\b", "h100-sxm"),
    (r"\ba100\b.*\b80\s*gb\b", "a100-80gb"),
    (r"\bl4\b", "l4"),
    (r"\bmi300x\b", "mi300x"),
)
HOW_TO_PRICE = "--price-per-hour P (USD per device-hour)"


def million_token_cost(usd_per_hour: float | None, tokens_per_s: float) -> float:
    """USD per million output tokens of a one-device deployment at ``tokens_per_s``
    (:func:`~search.roofline.operating_point.usd_per_million_tokens`); NaN without a price
    or without tokens."""
    if usd_per_hour is None or not (tokens_per_s > 0) or not math.isfinite(tokens_per_s):
        return math.nan
    return usd_per_million_tokens(usd_per_hour, 1, tokens_per_s)


def catalog_price(device_name: str) -> tuple[float, str] | None:
    """``(usd_per_hour, source)`` of the catalogued part named ``device_name`` (a CUDA
    device name such as ``NVIDIA H100 80GB HBM3``), or None when the catalog has no such
    part or no price for it. Never a price for a CPU."""
    from search.roofline.hardware import CATALOG

    name = device_name.lower()
    for pattern, key in _GPU_NAMES:
        if re.search(pattern, name) and key in CATALOG:
            spec = CATALOG[key]
            if spec.usd_per_hour > 0:
                return spec.usd_per_hour, (
                    f"indicative on-demand rate of the catalogued {key} "
                    f"(search/roofline/hardware.py), not a quote: override with {HOW_TO_PRICE}"
                )
    return None


def cost_sentence(usd_per_hour: float | None, tokens_per_s: float, source: str = "") -> str:
    """One plain sentence on what a million output tokens cost at ``tokens_per_s``."""
    if not (math.isfinite(tokens_per_s) and tokens_per_s > 0):
        return "No cost: nothing was generated at this point."
    if usd_per_hour is None:
        per_dollar = million_token_cost(1.0, tokens_per_s)
        return (
            f"No device price was given, so no cost per million tokens: at {tokens_per_s:.0f} "
            f"tokens/s every $1/h of device price is ${per_dollar:.3g} per million output "
            f"tokens. Give {HOW_TO_PRICE} to tune, or to `slotune export STUDY` to rebuild "
            "this report with it."
        )
    cost = million_token_cost(usd_per_hour, tokens_per_s)
    why = f" ({source})" if source else ""
    return f"At ${usd_per_hour:g}/h{why} that is ${cost:.3g} per million output tokens."
