"""CPU tensors on transparent huge pages, for the buffers decode streams every step.

A decode step reads every packed weight copy (serving/kernels/cpu_kernels.py) and the
KV cache once, page by page; on a VM each TLB miss walks two page tables (the guest's
and the host's), so these buffers go on 2 MiB pages (``madvise(MADV_HUGEPAGE)``, the
kernel's "madvise" THP mode; docs/serving.md "CPU kernels" has the gain). The
calibration's bandwidth probe (search/calibrate/device.py) reads a buffer made here too,
so the roofline's bandwidth is what the same kind of memory gives.

``empty`` returns an uninitialised tensor whose storage starts on a 2 MiB boundary, with
the advice given before any page is touched; where the advice is refused (no THP, not
Linux) it is an ordinary tensor on ordinary pages. Small tensors are not worth it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Callable
from functools import lru_cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


@lru_cache(maxsize=1)
def _madvise() -> Callable[..., int] | None:
    """libc's madvise, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(
    shape: int | tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, on huge pages where it can be:
    CPU, at least one huge page of bytes, and the kernel takes the advice."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dev = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    madvise = _madvise()
    if dev.type != "cpu" or nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    # A mapping of its own: untouched pages, whatever malloc would have reused.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps the mapping alive
    off = -raw.data_ptr() % HUGE_PAGE
    madvise(raw.data_ptr() + off, nbytes - nbytes % 4096, MADV_HUGEPAGE)  # refused: 4 KiB
    return raw[off : off + nbytes].view(dtype).view(shape)
