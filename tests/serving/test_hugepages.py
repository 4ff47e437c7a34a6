"""serving/kernels/hugepages.py: tensors like torch.empty's, on 2 MiB pages where the kernel
takes the advice."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from serving.kernels import hugepages


def anon_huge_kib() -> int | None:
    path = Path("/proc/self/smaps_rollup")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.read_text() if path.exists() else None


@pytest.mark.parametrize("shape", [(3 << 20,), (2, 3, 4096, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_big_tensor_is_what_torch_empty_gives_on_an_aligned_start(shape, dtype) -> None:
    t = hugepages.empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.device.type == "cpu"
    t.fill_(1.5)  # writable, every element
    assert float(t.float().sum()) == 1.5 * t.numel()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0


def test_a_small_tensor_is_a_plain_one() -> None:
    t = hugepages.empty((7, 5), torch.float32)
    assert t.shape == (7, 5) and t.untyped_storage().nbytes() == 7 * 5 * 4


@pytest.mark.skipif(
    thp_mode() is None or "[never]" in (thp_mode() or ""), reason="no transparent huge pages"
)
def test_its_pages_are_huge_where_the_kernel_has_them() -> None:
    before = anon_huge_kib()
    if before is None:
        pytest.skip("no /proc/self/smaps_rollup")
    t = hugepages.empty((64 << 20) // 4, torch.float32).fill_(1.0)  # touched: faulted in
    after = anon_huge_kib()
    assert after is not None and after - before >= 32 << 10  # at least half of its 64 MiB
    del t


def test_the_packed_copies_and_the_cache_get_it() -> None:
    from serving.model.config import ModelConfig
    from serving.model.transformer import Transformer

    cfg = ModelConfig.from_name("tiny").replace(name="hp", d_model=1024, intermediate_size=2048)
    m = Transformer.random(cfg, seed=1)
    m.allocate_cache(8, 512)
    for c in m.caches():  # [2, 8, 4, 512, 32] bf16: 2 MiB
        assert c.data_ptr() % hugepages.HUGE_PAGE == 0 and not c.any()
    if m.use_cpu_kernels() and m.kernels.gemv_isa is not None:
        big = m.model.layers[0].mlp.gate_up_proj  # [4096, 1024] bf16: 8 MiB
        assert big.rows8.data_ptr() % hugepages.HUGE_PAGE == 0
