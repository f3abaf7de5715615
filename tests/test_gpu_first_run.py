"""Defects of the GPU executor found before its first run on a GPU, checked without one: the cache
control step creates no tensor from a host value (a CUDA graph capture forbids the copy), memory is
counted on the device that holds it (meta tensors stand in for GPU ones), and the expert pool is
registered with CUDA in whole, merged pages (a fake CUDA runtime stands in for the real one)."""

from __future__ import annotations

import math
import mmap
from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hearth.engine.executor.memory_plan import bytes_by_device, executor_bytes, tensor_bytes
from hearth.engine.experts.mechanism.device import page_ranges, pin_host_memory
from hearth.engine.experts.policy.cache import ExpertCacheTables, cache_step
from hearth.engine.kernels.gpu import device_fill

PAGE = 4096  # of the pure range arithmetic's cases
HOST_PAGE = mmap.PAGESIZE  # of the fake CUDA runtime, as pin_host_memory registers them
# How a traced graph shows a tensor made from a host value (on a GPU, a host -> device copy): a constant
# lifted into the graph. (``scalar_tensor`` on the step's device, from a Python scalar operand, is a
# fill on the device.)
HOST_TENSOR_OPS = ("lift_fresh", "_tensor_constant")


def host_tensors_in(graph: torch.fx.GraphModule) -> list[str]:
    """The nodes of ``graph`` that make a tensor of a host value or read a constant tensor."""
    return [str(n.target) for n in graph.graph.nodes
            if n.op == "get_attr" or any(op in str(n.target) for op in HOST_TENSOR_OPS)]


# -- 1. the cache-control step runs inside a captured CUDA graph --------------------------------------
def test_cache_step_creates_no_tensor_from_a_host_value() -> None:
    tables = ExpertCacheTables(16, 4, torch.tensor([0, 1, 2, 2, 3]), max_fills=3)
    state = [tables.slot_of, tables.expert_of, tables.last_used, tables.clock, tables.qtable, tables.stats]

    def step(ids, *tensors):
        return cache_step(ids, *tensors, tables.num_candidates)

    graph = make_fx(step)(torch.tensor([3, 5, 3, 9, 11]), *[t.clone() for t in state])
    assert host_tensors_in(graph) == []
    # and it still plans as before: 4 distinct misses, q = qtable[4] = 3 fills, bounded by K = 3
    plan = tables.step(torch.tensor([3, 5, 3, 9, 11]), step_fn=cache_step)
    assert int(plan.count) == 3 and tables.read_stats()["misses"] == 4


def test_step_without_slots_creates_no_tensor_from_a_host_value() -> None:
    tables = ExpertCacheTables(16, 0, torch.tensor([0, 1, 2]), max_fills=2)

    def step(ids, stats):
        tables.stats = stats  # an input, not a constant of the graph
        plan = tables._step_without_slots(ids)
        return plan.pair_slot, plan.src, plan.dst, plan.count

    assert host_tensors_in(make_fx(step)(torch.tensor([4, 2, 4]), tables.stats.clone())) == []


# -- 2. memory counted on the device that holds it -------------------------------------------------------
def test_meta_storages_are_counted_each_once() -> None:
    """Meta storages have no address (data_ptr 0): they must not collapse into one."""
    a, b = torch.empty(100, device="meta"), torch.empty(30, dtype=torch.bfloat16, device="meta")
    host = torch.zeros(10)
    tensors = [a, a[10:], a.view(10, 10), b, host, host[:5]]
    assert bytes_by_device(tensors) == {"meta": 460, "cpu": 40}
    assert tensor_bytes(tensors, "meta") == 460 and tensor_bytes(tensors, "cpu") == 40
    assert tensor_bytes(tensors, None) == 500


def test_vram_sizing_counts_the_executors_device() -> None:
    """What --vram-limit counts (the dense weights and the KV cache) is on the executor's device;
    the host memory plan counts none of it there."""
    model = torch.nn.Linear(64, 32, device="meta")
    model.register_buffer("table", torch.empty(16, device="meta"))
    kv = SimpleNamespace(keys=[torch.empty(2, 8, device="meta")], values=[torch.empty(2, 8, device="meta")])
    expected = (64 * 32 + 32 + 16 + 2 * 16) * 4
    assert executor_bytes(model, kv, torch.device("meta")) == expected
    assert executor_bytes(model, kv, torch.device("cpu")) == 0


def test_profile_counts_dense_weights_wherever_they_are() -> None:
    from hearth.cli.profile import memory_report

    model = torch.nn.Linear(64, 32, device="meta")
    cfg = SimpleNamespace(kv_bytes_per_token=1024, max_position_embeddings=4096, layer_range=None)
    pool = SimpleNamespace(expert_bytes=1 << 20, gate_up=torch.empty(8, 1, device="meta"))
    report = memory_report(SimpleNamespace(model=model, pool=pool), cfg)
    assert report["dense_weight_bytes"] == (64 * 32 + 32) * 4


# -- 3. host registration in whole, merged pages ---------------------------------------------------------
@pytest.mark.parametrize(("spans", "ranges"), [
    ([], []),
    ([(100, 0)], []),  # zero-size: nothing
    ([(0, PAGE), (PAGE, 2 * PAGE)], [(0, 3 * PAGE)]),  # aligned and adjacent: merged
    ([(4 * PAGE, PAGE)], [(4 * PAGE, PAGE)]),  # aligned: itself
    ([(100, 2000), (2100, 6900)], [(0, 3 * PAGE)]),  # two tensors sharing a page
    ([(PAGE + 10, 50), (PAGE + 30, 5000)], [(PAGE, 2 * PAGE)]),  # overlapping
    ([(3 * PAGE + 1, 1), (10, 20), (8 * PAGE, 0)], [(0, PAGE), (3 * PAGE, PAGE)]),  # apart, unsorted
    ([(PAGE - 1, 2)], [(0, 2 * PAGE)]),  # two bytes across a page boundary
])
def test_page_ranges(spans, ranges) -> None:
    assert page_ranges(spans, PAGE) == ranges


class FakeCudart:
    """Registration as CUDA does it: whole pages, each page at most once; unregistering by the start."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.ranges: dict[int, int] = {}
        self.tried: list[int] = []  # range starts, in the order first tried
        self.fail_at = fail_at  # the n-th range (from 1) fails, however often it is tried

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - the runtime's name
        if ptr not in self.tried:
            self.tried.append(ptr)
        if self.tried.index(ptr) + 1 == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        first, end = ptr // HOST_PAGE * HOST_PAGE, -(-(ptr + size) // HOST_PAGE) * HOST_PAGE
        if any(first < s + n and s < end for s, n in self.ranges.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        assert flags == 2
        self.ranges[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.ranges[ptr]
        return 0


def test_banks_sharing_a_page_are_registered_once(monkeypatch) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    base = torch.empty(4 * HOST_PAGE, dtype=torch.uint8)
    first = -(-base.data_ptr() // HOST_PAGE) * HOST_PAGE - base.data_ptr()  # offset of the first whole page
    # Two banks as the heap places them (64-byte aligned): the first ends inside the page the second starts in.
    cut = first + HOST_PAGE // 2
    gate_up, down = base[first + 64 : cut], base[cut : first + 2 * HOST_PAGE + 64]
    registered = pin_host_memory([gate_up, down, torch.empty(0)])
    assert registered == [base.data_ptr() + first] and cudart.ranges == {registered[0]: 3 * HOST_PAGE}
    for ptr in registered:
        cudart.cudaHostUnregister(ptr)
    assert cudart.ranges == {}


class ReadOnlyCudart(FakeCudart):
    """A read-only mapping (a pool attached by name) as x86 CUDA treats it: refused without the
    read-only flag, which then sets an error the next checked call would report."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: list[int] = []
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.flags.append(flags)
        if not flags & 8:
            self.last_error = 1  # cudaErrorInvalidValue
            return 1
        self.ranges[ptr] = size
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802
        error, self.last_error = self.last_error, 0
        return error


def test_a_read_only_pool_is_registered_read_only(monkeypatch) -> None:
    from hearth.engine.kernels.gpu import device_fill

    cudart = ReadOnlyCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(device_fill, "cuda_runtime", lambda: cudart)
    bank = torch.empty(2 * HOST_PAGE, dtype=torch.uint8)
    registered = pin_host_memory([bank])
    assert cudart.flags == [2, 2 | 8] and list(cudart.ranges) == registered
    assert cudart.last_error == 0  # the refused first try left no error behind


def test_a_failed_registration_leaves_nothing_registered(monkeypatch) -> None:
    cudart = FakeCudart(fail_at=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    base = torch.empty(8 * HOST_PAGE, dtype=torch.uint8)
    apart = [base[:HOST_PAGE], base[-HOST_PAGE:]]
    if len(page_ranges([(t.data_ptr(), t.nbytes) for t in apart])) < 2:
        pytest.skip("the two buffers landed in adjacent pages")
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        pin_host_memory(apart)
    assert cudart.ranges == {}
    with pytest.raises(ValueError, match="contiguous"):
        pin_host_memory([torch.empty(4, 4).t()])


# -- 4. the fill kernel's grid is bounded ------------------------------------------------------------------
class GridRecorder:
    """A stand-in for a jitted kernel: records the grids it is launched with."""

    def __init__(self) -> None:
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


def test_fill_grid_is_bounded_at_qwen3_30b_shapes() -> None:
    """Hidden 2048, expert FFN 768, 128 experts x 48 layers, bf16: up to 128 fills per layer call. The
    launch is a few hundred programs (it was ~150k for the two banks), whatever the count."""
    experts, slots, hidden, inter = 128 * 48, 1024, 2048, 768
    kernel = GridRecorder()
    row_table = torch.empty(experts, dtype=torch.long, device="meta")
    src, dst = torch.empty(128, dtype=torch.long, device="meta"), torch.empty(128, dtype=torch.long, device="meta")
    for shape in ((2 * inter, hidden), (hidden, inter)):
        arena = torch.empty(slots, *shape, dtype=torch.bfloat16, device="meta")
        pool = torch.empty(experts, *shape, dtype=torch.bfloat16, device="meta")
        for count in (0, 1, 128):
            device_fill.fill_rows(arena, pool, row_table, src, dst, torch.tensor(count), kernel=kernel)
    assert len(set(kernel.grids)) == 1, kernel.grids  # one launch shape: a graph replays it
    assert all(math.prod(grid) <= 1024 for grid in kernel.grids), kernel.grids
