"""slotune's CPU kernels (serving/kernels/cpu_kernels.c), built at first use.

Decode attention (one call a layer, reading only each sequence's own positions, where
torch runs ~15 small ops over whole ``max_len`` rows), RMSNorm, the GEMV of small
batches, the small GEMM past it on AVX2, and whole decoder layers at the GEMV's batches
(docs/serving.md "CPU kernels" has what each does and what it saves).

The source is compiled by the system C compiler (``$CC``, else ``cc``/``gcc``) with
``-march=native`` into a per-user cache (``$SLOTUNE_KERNEL_CACHE``, else
``~/.cache/slotune/kernels``), keyed by the source, the flags, the compiler and the
CPU's flags; a build is reused by every later process (Ray replicas included). The
cache must be private (this user's, writable by no one else: serving/kernels/build_cache.py)
and a library is loaded only when it matches the checksum recorded at its build. No
compiler, a failed build, a shared cache, a CPU other than x86-64, or ``SLOTUNE_CPU_KERNELS=0``:
:func:`load` returns None and the model keeps its torch path (same results to rounding
order). The attention kernel serves bf16 decode steps (prefill runs torch), the norm
every bf16 forward on CPU; fp32/fp16 and CUDA run torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from serving.kernels import build_cache, cpu_step, hugepages

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",  # lets the compiler vectorize the fp32 sums of the scalar path
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
ENV_SWITCH = "SLOTUNE_CPU_KERNELS"

_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
PATHS = {1: "AVX-512 bf16", 2: "AVX2"}  # slotune_kernel_limits' return -> the GEMV's path
# Rows of input up to which a linear runs the GEMV, by path: past them oneDNN (AVX-512) or
# the small GEMM (AVX2) is faster (docs/serving.md "CPU kernels" has the A/B figures).
GEMV_ROWS = {1: 2, 2: 1}


class Kernels:
    """The loaded library: :meth:`decode_attention` and its limits."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._attn = lib.slotune_decode_attention_bf16
        self._attn.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _C]
        self._attn.restype = ctypes.c_int
        self._norm = lib.slotune_rms_norm_bf16
        self._norm.argtypes = [_P, _P, _P, _I, _I, _F, _C]
        self._norm.restype = None
        limits = lib.slotune_kernel_limits
        limits.argtypes = [ctypes.POINTER(_I), ctypes.POINTER(_I)]
        limits.restype = ctypes.c_int
        d, g = _I(), _I()
        built = limits(ctypes.byref(d), ctypes.byref(g))
        self.max_head_dim, self.max_group = d.value, g.value
        # The instruction set the GEMV and whole-layer kernels were built for (see
        # cpu_kernels.c): "AVX-512 bf16", "AVX2" (bf16 widened to fp32), or None.
        self.gemv_isa = PATHS.get(built)
        self.vector_path = built == 1  # AVX-512 bf16: the vector attention too
        if self.gemv_isa is not None:
            self._pack = lib.slotune_pack_rows8_bf16
            self._pack.argtypes = [_P, _P, _I, _I]
            self._pack.restype = None
            self._gemv = lib.slotune_gemv_bf16
            self._gemv.argtypes = [_P, _P, _P, _P, _I, _I, _I, _C]
            self._gemv.restype = None
            self._layer = lib.slotune_decode_layer_bf16
            # x_in, x_out, norm1, norm2, eps1, eps2, 4 weights, cache, cos, sin,
            # positions, slots; M, d, I, H, Hkv, D, S, L, P; scale, threads
            self._layer.argtypes = [_P] * 4 + [_F] * 2 + [_P] * 9 + [_I] * 9 + [_F, _C]
            self._layer.restype = ctypes.c_int
        # The whole decode step in one call (serving/kernels/cpu_step.py), on the same paths.
        self.step_fn = cpu_step.bind(lib) if self.gemv_isa is not None else None
        # Rows up to which a linear runs the GEMV (and a decode layer the whole-layer call):
        # on AVX2 two rows already run faster through the small GEMM below.
        self.gemv_rows = GEMV_ROWS.get(built, 0)
        self.has_gemm = built == 2  # the AVX2 small GEMM (see gemm)
        if self.has_gemm:
            self._pack16 = lib.slotune_pack_cols16_bf16
            self._pack16.argtypes = [_P, _P, _I, _I]
            self._pack16.restype = None
            self._gemm = lib.slotune_gemm_bf16
            self._gemm.argtypes = [_P, _P, _P, _P, _I, _I, _I, _C]
            self._gemm.restype = None

    def supports_gemv(self, out_features: int, in_features: int) -> bool:
        return self.gemv_isa is not None and out_features % 8 == 0 and in_features % 32 == 0

    def supports_gemm(self, out_features: int) -> bool:
        return self.has_gemm and out_features % 16 == 0

    def pack_cols16(self, weight: torch.Tensor) -> torch.Tensor:
        """The small GEMM's copy of a bf16 weight [O, I] (see :meth:`gemm`)."""
        w = weight.detach().contiguous()
        packed = hugepages.empty(w.numel(), w.dtype)  # streamed every step: huge pages
        self._pack16(w.data_ptr(), packed.data_ptr(), w.shape[0], w.shape[1])
        return packed

    def gemm(
        self,
        x: torch.Tensor,  # [..., I] bf16
        packed: torch.Tensor,  # from pack_cols16 of a weight [O, I]
        out_features: int,
        residual: torch.Tensor | None = None,  # [..., O] bf16, contiguous
    ) -> torch.Tensor:
        """``x @ W.T`` (``+ residual``) for any number of rows on the AVX2 path: fp32 FMAs
        on bf16 weights widened in registers (x widened once), fp32 sums over the input
        features in order, rounded once: [..., O] bf16."""
        i = x.shape[-1]
        x32 = x.reshape(-1, i).float().contiguous()  # [M, I] (float keeps a dense layout)
        out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        self._gemm(
            x32.data_ptr(),
            packed.data_ptr(),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
            x32.shape[0],
            out_features,
            i,
            torch.get_num_threads(),
        )
        return out

    def pack_rows8(self, weight: torch.Tensor) -> torch.Tensor:
        """The GEMV's copy of a bf16 weight [O, I] (see :meth:`gemv`)."""
        w = weight.detach().contiguous()
        packed = hugepages.empty(w.numel(), w.dtype)  # streamed every step: huge pages
        if packed.data_ptr() % 64:
            raise RuntimeError("GEMV weight copy not 64-byte aligned")
        self._pack(w.data_ptr(), packed.data_ptr(), w.shape[0], w.shape[1])
        return packed

    def gemv(
        self,
        x: torch.Tensor,  # [..., I] bf16, contiguous
        packed: torch.Tensor,  # from pack_rows8 of a weight [O, I]
        out_features: int,
        residual: torch.Tensor | None = None,  # [..., O] bf16, contiguous
    ) -> torch.Tensor:
        """``x @ W.T`` (``+ residual``), fp32 sums rounded once: [..., O] bf16."""
        i = x.shape[-1]
        out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
        self._gemv(
            x.data_ptr(),
            packed.data_ptr(),
            None if residual is None else residual.data_ptr(),
            out.data_ptr(),
            x.numel() // i,
            out_features,
            i,
            torch.get_num_threads(),
        )
        return out

    def decode_layer(
        self,
        x: torch.Tensor,  # [B, 1, d] bf16, contiguous
        layer: Any,  # serving.model.transformer.Block whose four linears have GEMV copies (rows8)
        ctx: Any,  # serving.model.step_context.StepContext of a decode step with these kernels
    ) -> torch.Tensor:
        """A whole decoder layer of a decode step in one call: the norms, the four
        linears (GEMV), decode attention (as :meth:`decode_attention`), SwiGLU and both
        residual adds, op for op as ``Block.forward`` runs them with the kernels (the
        same roundings). Returns the layer's output [B, 1, d] bf16."""
        attn, mlp = layer.self_attn, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        out = torch.empty_like(x)
        tail = cpu_step.call_tail(x, layer, ctx)
        rc = self._layer(
            x.data_ptr(),
            out.data_ptr(),
            n1.weight.data_ptr(),
            n2.weight.data_ptr(),
            n1.eps,
            n2.eps,
            attn.qkv_proj.rows8.data_ptr(),
            attn.o_proj.rows8.data_ptr(),
            mlp.gate_up_proj.rows8.data_ptr(),
            mlp.down_proj.rows8.data_ptr(),
            attn.kv_cache.data_ptr(),
            *tail,
        )
        cpu_step.check_call(self, rc, tail, ctx)
        return out

    def supports(self, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
        g = n_heads // n_kv_heads
        return head_dim % 2 == 0 and head_dim <= self.max_head_dim and g <= self.max_group

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``torch.rms_norm(x, (d,), weight, eps)`` for a contiguous bf16 ``x`` [..., d]
        and bf16 ``weight`` [d] (fp32 math, one rounding: the same bits)."""
        d = x.shape[-1]
        out = torch.empty_like(x)
        self._norm(
            x.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            x.numel() // d,
            d,
            eps,
            torch.get_num_threads(),
        )
        return out

    def decode_attention(
        self,
        qkv: torch.Tensor,  # [B, H + 2*Hkv, D] bf16, contiguous
        cache: torch.Tensor,  # [2, S, Hkv, L, D] bf16, contiguous
        cos: torch.Tensor,  # [P, D] bf16
        sin_signed: torch.Tensor,  # [P, D] bf16, first half negated
        positions: torch.Tensor,  # [B] int64, each < L and < P
        slots: torch.Tensor,  # [B] int64, distinct, each < S
        n_heads: int,
        scale: float,
    ) -> torch.Tensor:
        """Rotary q and k, K/V written at ``(slot, position)``, attention over positions
        ``0..position`` of each slot. Returns [B, n_heads * D] bf16.

        The caller guarantees shapes, dtypes and contiguity (the model builds them);
        positions and slots out of range raise IndexError (checked in C, nothing
        written)."""
        b, _, d = qkv.shape
        _, s, hkv, length, _ = cache.shape
        out = torch.empty(b, n_heads * d, dtype=qkv.dtype)
        rc = self._attn(
            qkv.data_ptr(),
            cache.data_ptr(),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            out.data_ptr(),
            b,
            n_heads,
            hkv,
            d,
            s,
            length,
            cos.shape[0],
            scale,
            torch.get_num_threads(),
        )
        self._check(rc, length, cos.shape[0], s, positions, slots)
        return out

    @staticmethod
    def _check(
        rc: int, length: int, table: int, s: int, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if rc == -2:
            raise IndexError(
                f"decode attention kernel: a position outside [0, {min(length, table)}) "
                f"or a slot outside [0, {s}) (positions {positions.tolist()}, slots "
                f"{slots.tolist()})"
            )
        if rc != 0:
            raise MemoryError("decode attention kernel: scratch allocation failed")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    env = os.environ.get("SLOTUNE_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "slotune" / "kernels"


def _key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    src = SOURCE.read_bytes()
    return hashlib.sha256(
        b"\0".join((src, " ".join(FLAGS).encode(), version.encode(), _cpu_flags().encode()))
    ).hexdigest()[:16]


def _compile(cc: str, target: Path) -> None:
    # Built under a temporary name, its checksum recorded, then renamed into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120
        )
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed: {res.stderr.strip().splitlines()[-1:]}")
        build_cache.install(Path(tmp), target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_built(directory: Path | None) -> tuple[Path, int]:
    """The library's path and a verified, open descriptor of it: found in the private
    cache when it checks out (build_cache.open_verified), else compiled there."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    directory = build_cache.private_dir(directory or cache_dir())
    target = directory / f"slotune_cpu_kernels-{_key(cc)}.so"
    with build_cache.locked(directory):  # replicas starting together compile once
        fd = build_cache.open_verified(target)
        if fd is None:
            _compile(cc, target)
            fd = build_cache.open_verified(target)
        if fd is None:
            raise RuntimeError(f"{target}: the library just built does not verify")
    return target, fd


def build(directory: Path | None = None) -> Path:
    """Compile the kernels (or find them already built and verified); returns the
    library's path. RuntimeError with the compiler's message when it cannot, and
    build_cache.UnsafeCache when the cache directory is not private to this user."""
    target, fd = _open_built(directory)
    os.close(fd)
    return target


@lru_cache(maxsize=1)
def load() -> Kernels | None:
    """The kernels for this process, or None (logged once) where they cannot be used."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU kernels off (%s=0): decode attention runs torch ops", ENV_SWITCH)
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.info("CPU kernels: built for x86-64 only, not %s", platform.machine())
        return None
    try:
        path, fd = _open_built(None)
        try:  # load the descriptor that was verified, not the name again
            by_fd = f"/proc/self/fd/{fd}"
            kernels = Kernels(ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(path)), path)
        finally:
            os.close(fd)
    except build_cache.UnsafeCache as exc:
        logger.warning(
            "CPU kernels not loaded: %s; set SLOTUNE_KERNEL_CACHE to a directory only this "
            "user can write. Decode attention runs torch ops",
            exc,
        )
        return None
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable (%s): decode attention runs torch ops", exc)
        return None
    logger.info(
        "CPU kernels loaded from %s (%s path)",
        path,
        kernels.gemv_isa or "scalar, no GEMV",
    )
    return kernels


def for_model(
    device: torch.device, dtype: torch.dtype, n_heads: int, n_kv_heads: int, head_dim: int
) -> Kernels | None:
    """The kernels where a decode step of this model runs them (CPU, bf16, a head layout
    they support, built here), else None: the rule the serving model and the
    calibration (search/calibrate/shapes.py) share."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    k = load()
    return k if k is not None and k.supports(n_heads, n_kv_heads, head_dim) else None
