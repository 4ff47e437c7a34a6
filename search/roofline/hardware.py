"""Accelerator specs: a catalog of datacenter parts, JSON files, and calibrated devices.

A :class:`HardwareSpec` carries what the roofline needs: dense peak FLOP/s per
dtype, memory bandwidth and capacity, the interconnect used by tensor
parallelism, and an hourly price. A spec written by ``slotune calibrate`` also
carries what the device *achieves* at decode shapes (see :class:`DecodeProfile`),
so the roofline can predict a real step time on it, not only the ideal bound.

Catalog figures are the vendors' datasheet numbers for dense math (the
"with sparsity" figures are halved); prices are indicative on-demand cloud
rates per device-hour, meant to be overridden with ``--price-per-hour``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from search.roofline.profile import DecodeProfile, check_non_negative, check_positive

logger = logging.getLogger(__name__)


DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
BYTES_PER_ELEM = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

TB = 1e12
GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """One accelerator (per device figures)."""

    name: str
    peak_flops: Mapping[str, float]  # dtype -> dense FLOP/s
    mem_bandwidth: float  # bytes/s
    mem_capacity: float  # bytes
    interconnect_bandwidth: float = 0.0  # bytes/s per device, one direction
    interconnect_latency_s: float = 0.0  # one small all-reduce, seconds
    usd_per_hour: float = 0.0  # per device
    # Filled by calibration: dtype -> what decode shapes achieve on this device.
    decode: Mapping[str, DecodeProfile] = field(default_factory=dict)
    source: str = ""  # where the numbers come from

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r}: must be a non-empty string")
        if not self.peak_flops:
            raise ValueError(f"{self.name}: peak_flops is empty; give at least one of {DTYPES}")
        for dt, v in self.peak_flops.items():
            if dt not in DTYPES:
                raise ValueError(f"{self.name}: peak_flops dtype {dt!r} unknown; allowed: {DTYPES}")
            check_positive(f"{self.name}: peak_flops[{dt}]", v)
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        check_positive(f"{self.name}: mem_bandwidth", self.mem_bandwidth)
        check_positive(f"{self.name}: mem_capacity", self.mem_capacity)
        check_non_negative(f"{self.name}: interconnect_bandwidth", self.interconnect_bandwidth)
        check_non_negative(f"{self.name}: interconnect_latency_s", self.interconnect_latency_s)
        check_non_negative(f"{self.name}: usd_per_hour", self.usd_per_hour)
        for dt, prof in self.decode.items():
            if dt not in DTYPES:
                raise ValueError(f"{self.name}: decode dtype {dt!r} unknown; allowed: {DTYPES}")
            if not isinstance(prof, DecodeProfile):
                raise ValueError(f"{self.name}: decode[{dt}] must be a DecodeProfile")
        object.__setattr__(self, "decode", MappingProxyType(dict(self.decode)))

    # ---- derived -----------------------------------------------------------------

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s in ``dtype``; ValueError naming the dtypes this device has."""
        if dtype not in self.peak_flops:
            raise ValueError(
                f"dtype={dtype!r}: {self.name} has no peak for it; "
                f"allowed: {', '.join(self.peak_flops)}"
            )
        return float(self.peak_flops[dtype])

    def ridge_flops_per_byte(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity at which compute time equals memory time."""
        return self.flops(dtype) / self.mem_bandwidth

    @property
    def calibrated(self) -> bool:
        return bool(self.decode)

    def without_calibration(self) -> HardwareSpec:
        """The same device as peaks only: the roofline then gives its ideal bound."""
        return dataclasses.replace(self, decode={})

    # ---- constructors and persistence -------------------------------------------

    @classmethod
    def from_name(cls, name: str) -> HardwareSpec:
        try:
            return CATALOG[name]
        except KeyError:
            raise ValueError(
                f"hardware {name!r} is not in the catalog; allowed: {', '.join(HARDWARE_NAMES)} "
                "(or a JSON file path)"
            ) from None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["peak_flops"] = dict(self.peak_flops)
        d["decode"] = {dt: p.to_dict() for dt, p in self.decode.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareSpec:
        known = {
            "name",
            "peak_flops",
            "mem_bandwidth",
            "mem_capacity",
            "interconnect_bandwidth",
            "interconnect_latency_s",
            "usd_per_hour",
            "decode",
            "source",
        }
        extra = sorted(set(d) - known - {"measured"})
        if extra:
            raise ValueError(f"unknown hardware field(s) {extra}; allowed: {sorted(known)}")
        missing = sorted({"name", "peak_flops", "mem_bandwidth", "mem_capacity"} - set(d))
        if missing:
            raise ValueError(f"hardware spec lacks field(s) {missing}")
        kw = {k: v for k, v in d.items() if k in known}
        kw["peak_flops"] = {str(k): float(v) for k, v in d["peak_flops"].items()}
        kw["decode"] = {
            str(dt): DecodeProfile.from_dict(p) for dt, p in (d.get("decode") or {}).items()
        }
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | Path) -> HardwareSpec:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ValueError(f"hardware file {str(p)!r}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(
                f"hardware file {str(p)!r}: not JSON ({e.msg}, line {e.lineno})"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(f"hardware file {str(p)!r}: must hold a JSON object")
        try:
            return cls.from_dict(data)
        except (TypeError, AttributeError) as e:
            raise ValueError(f"hardware file {str(p)!r}: malformed ({e})") from None

    def to_json(self, path: str | Path, *, extra: Mapping[str, Any] | None = None) -> None:
        """Write the spec (plus an optional ``measured`` block kept for humans)."""
        d = self.to_dict()
        if extra:
            d["measured"] = dict(extra)
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(d, indent=2, sort_keys=False) + "\n")


def _h(name: str, **kw: Any) -> HardwareSpec:
    return HardwareSpec(name=name, **kw)


# Interconnect latency: a small (tens of KB) all-reduce costs a few microseconds
# over NVLink/Infinity Fabric with one-shot kernels (vLLM custom all-reduce,
# NCCL-tests small-message latency is ~10 us); over PCIe more. These are
# order-of-magnitude figures: they matter for single-stream TP decode only.
CATALOG: Mapping[str, HardwareSpec] = MappingProxyType(
    {
        # NVIDIA H100 SXM5 80GB datasheet (nvidia.com/en-us/data-center/h100):
        # BF16/FP16 tensor 1,979 TFLOPS with sparsity -> 989.4 dense; FP8 3,958 -> 1,979;
        # TF32 989 -> 494.7; FP32 67 (non-tensor). HBM3 80 GB at 3.35 TB/s.
        # NVLink 4: 900 GB/s total -> 450 GB/s per direction.
        "h100-sxm": _h(
            "h100-sxm",
            peak_flops={
                "bf16": 989.4 * TFLOPS,
                "fp16": 989.4 * TFLOPS,
                "fp8": 1978.9 * TFLOPS,
                "tf32": 494.7 * TFLOPS,
                "fp32": 66.9 * TFLOPS,
            },
            mem_bandwidth=3.35 * TB,
            mem_capacity=80 * GB,
            interconnect_bandwidth=450 * GB,
            interconnect_latency_s=8e-6,
            usd_per_hour=2.50,  # indicative on-demand rate, 2025 neoclouds ($2-3.5/GPU-h)
            source="NVIDIA H100 datasheet (SXM5), dense figures",
        ),
        # NVIDIA H100 PCIe 80GB datasheet: BF16 1,513 sparse -> 756 dense; FP8 3,026 -> 1,513;
        # TF32 756 -> 378; FP32 51. HBM2e 80 GB at 2.0 TB/s. NVLink bridge 600 GB/s
        # total (pairs) -> 300 GB/s per direction; PCIe Gen5 x16 is 64 GB/s per direction.
        "h100-pcie": _h(
            "h100-pcie",
            peak_flops={
                "bf16": 756.5 * TFLOPS,
                "fp16": 756.5 * TFLOPS,
                "fp8": 1513 * TFLOPS,
                "tf32": 378 * TFLOPS,
                "fp32": 51.2 * TFLOPS,
            },
            mem_bandwidth=2.0 * TB,
            mem_capacity=80 * GB,
            interconnect_bandwidth=300 * GB,
            interconnect_latency_s=10e-6,
            usd_per_hour=2.00,  # indicative on-demand rate
            source="NVIDIA H100 datasheet (PCIe), dense figures",
        ),
        # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): same compute as H100 SXM
        # (BF16 1,979 sparse -> 989 dense; FP8 3,958 -> 1,979); HBM3e 141 GB at 4.8 TB/s;
        # NVLink 900 GB/s total -> 450 per direction.
        "h200": _h(
            "h200",
            peak_flops={
                "bf16": 989.4 * TFLOPS,
                "fp16": 989.4 * TFLOPS,
                "fp8": 1978.9 * TFLOPS,
                "tf32": 494.7 * TFLOPS,
                "fp32": 66.9 * TFLOPS,
            },
            mem_bandwidth=4.8 * TB,
            mem_capacity=141 * GB,
            interconnect_bandwidth=450 * GB,
            interconnect_latency_s=8e-6,
            usd_per_hour=3.50,  # indicative on-demand rate
            source="NVIDIA H200 datasheet (SXM), dense figures",
        ),
        # NVIDIA A100 80GB SXM datasheet: BF16/FP16 tensor 312 TFLOPS dense; TF32 156;
        # FP32 19.5; no FP8. HBM2e 80 GB at 2,039 GB/s. NVLink 3: 600 GB/s total
        # -> 300 per direction.
        "a100-80gb": _h(
            "a100-80gb",
            peak_flops={
                "bf16": 312 * TFLOPS,
                "fp16": 312 * TFLOPS,
                "tf32": 156 * TFLOPS,
                "fp32": 19.5 * TFLOPS,
            },
            mem_bandwidth=2.039 * TB,
            mem_capacity=80 * GB,
            interconnect_bandwidth=300 * GB,
            interconnect_latency_s=10e-6,
            usd_per_hour=1.50,  # indicative on-demand rate
            source="NVIDIA A100 datasheet (80GB SXM), dense figures",
        ),
        # NVIDIA L4 datasheet: BF16/FP16 tensor 242 TFLOPS sparse -> 121 dense; FP8 485 -> 242.5;
        # TF32 120 -> 60; FP32 30.3. 24 GB GDDR6 at 300 GB/s. No NVLink: PCIe Gen4 x16,
        # 32 GB/s per direction.
        "l4": _h(
            "l4",
            peak_flops={
                "bf16": 121 * TFLOPS,
                "fp16": 121 * TFLOPS,
                "fp8": 242.5 * TFLOPS,
                "tf32": 60 * TFLOPS,
                "fp32": 30.3 * TFLOPS,
            },
            mem_bandwidth=300 * GB,
            mem_capacity=24 * GB,
            interconnect_bandwidth=32 * GB,
            interconnect_latency_s=25e-6,
            usd_per_hour=0.80,  # indicative on-demand rate (GCP g2 ~ $0.7-0.9/GPU-h)
            source="NVIDIA L4 datasheet, dense figures",
        ),
        # AMD Instinct MI300X datasheet (amd.com): BF16/FP16 matrix 1,307.4 TFLOPS dense;
        # FP8 2,614.9; TF32 653.7; FP32 matrix 163.4. HBM3 192 GB at 5.3 TB/s.
        # Infinity Fabric: 7 links x 64 GB/s per direction to the other 7 GPUs -> 448.
        "mi300x": _h(
            "mi300x",
            peak_flops={
                "bf16": 1307.4 * TFLOPS,
                "fp16": 1307.4 * TFLOPS,
                "fp8": 2614.9 * TFLOPS,
                "tf32": 653.7 * TFLOPS,
                "fp32": 163.4 * TFLOPS,
            },
            mem_bandwidth=5.3 * TB,
            mem_capacity=192 * GB,
            interconnect_bandwidth=448 * GB,
            interconnect_latency_s=10e-6,
            usd_per_hour=2.50,  # indicative on-demand rate
            source="AMD Instinct MI300X datasheet, dense figures",
        ),
    }
)

HARDWARE_NAMES: tuple[str, ...] = tuple(CATALOG)


def resolve_hardware(name_or_path: str) -> HardwareSpec:
    """A catalog name, or a path to a hardware JSON file (e.g. from ``slotune calibrate``)."""
    if name_or_path in CATALOG:
        return CATALOG[name_or_path]
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return HardwareSpec.from_json(p)
    return HardwareSpec.from_name(name_or_path)
