"""The count-aware fill kernel of captured decode steps (engine/kernels/gpu/device_fill.py), run by
Triton's interpreter on the CPU: it copies exactly the first ``count`` planned experts, read from a
tensor, whatever the bank's dtype and row size, and touches nothing else."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.kernels.gpu import device_fill


@pytest.fixture
def kernel(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device_fill.build_fill_kernel()  # built now, under the interpreter


@pytest.mark.parametrize(("dtype", "row_shape"), [(torch.float32, (6, 40)), (torch.bfloat16, (3, 50)),
                                                  (torch.uint8, (1, 2310)), (torch.uint8, (1, 77))])
def test_fill_copies_exactly_count_rows(kernel, dtype, row_shape) -> None:
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn((12, *row_shape), generator=g) * 50).to(dtype)
    row_table = torch.tensor([-1, -1, -1, -1] + list(range(12)))  # global ids 4.. map to pool rows
    src = torch.tensor([9, 4, 15, 7, -1, -1])  # planned fills (global ids), -1 past the count
    dst = torch.tensor([2, 0, 4, 1, -1, -1])
    for count in range(5):
        arena = torch.zeros((6, *row_shape), dtype=dtype)
        device_fill.fill_rows(arena, pool, row_table, src, dst, torch.tensor(count), kernel=kernel)
        expected = torch.zeros_like(arena)
        for j in range(count):
            expected[dst[j]] = pool[row_table[src[j]]]
        assert torch.equal(arena, expected), count


def test_word_view_and_mismatched_rows(kernel) -> None:
    assert device_fill.word_view(torch.zeros(4, 16, dtype=torch.uint8)).dtype == torch.int64
    assert device_fill.word_view(torch.zeros(4, 6, dtype=torch.uint8)).dtype == torch.int16
    assert device_fill.word_view(torch.zeros(4, 7, dtype=torch.uint8)).dtype == torch.uint8
    with pytest.raises(ValueError, match="different sizes"):
        device_fill.fill_rows(torch.zeros(2, 8), torch.zeros(2, 4), torch.arange(2), torch.zeros(1, dtype=torch.long),
                              torch.zeros(1, dtype=torch.long), torch.tensor(1), kernel=kernel)


@pytest.mark.parametrize(("programs", "block"), [(3, 16), (1, 16), (256, 1024)])
@pytest.mark.parametrize("row_words", [16, 37, 100])
def test_a_bounded_grid_loops_over_every_fill_and_chunk(kernel, monkeypatch, programs, block, row_words) -> None:
    """Fewer programs than (fills x chunks), rows not a multiple of the block: every program loops over
    its share; counts of none, some, all the candidates (and past them: only the plan is read)."""
    monkeypatch.setattr(device_fill, "BLOCK", block)
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(-2**62, 2**62, (10, row_words), generator=g)
    row_table = torch.tensor([7, -1, 3, 0, 9, 2, 5, 1])
    src, dst = torch.tensor([2, 6, 0, 4, 7]), torch.tensor([3, 0, 5, 1, 6])
    for count in (0, 2, 5, 7):
        arena = torch.zeros(7, row_words, dtype=torch.long)
        device_fill.fill_rows(arena, pool, row_table, src, dst, torch.tensor(count), kernel=kernel, programs=programs)
        expected = torch.zeros_like(arena)
        n = min(count, src.numel())
        expected[dst[:n]] = pool[row_table[src[:n]]]
        assert torch.equal(arena, expected), (count, programs, block)
