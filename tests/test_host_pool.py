"""The shared-memory host pool and the CPU expert worker process attached to it by name."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from hearth.engine.experts.mechanism.cpu_workers import CpuExpertWorkers
from hearth.engine.experts.mechanism.host_pool import HostExpertPool, cleanup, list_pools
from hearth.engine.experts.mechanism.ring import RingCpuWorkers, RingLayout, TaskRing
from hearth.engine.ops import activation

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX shared memory")
E_ROWS, H, I, K = 24, 64, 32, 4


def unique(prefix: str) -> str:
    return f"test-{prefix}-{uuid.uuid4().hex[:8]}"


def filled_pool(name: str, dtype: torch.dtype) -> HostExpertPool:
    pool = HostExpertPool.create(name, (E_ROWS, 2 * I, H), (E_ROWS, H, I), dtype)
    g = torch.Generator().manual_seed(0)
    pool.gate_up.copy_(torch.randn(pool.gate_up.shape, generator=g) * 0.1)
    pool.down.copy_(torch.randn(pool.down.shape, generator=g) * 0.1)
    return pool


class _PoolView:
    """The few ExpertPool attributes the CPU workers use."""

    def __init__(self, hp: HostExpertPool) -> None:
        self.gate_up, self.down = hp.tensors
        self.expert_bytes = (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()


def test_attach_by_name_from_another_process():
    pool = filled_pool(unique("attach"), torch.float32)
    try:
        code = ("import sys; from hearth.engine.experts.mechanism.host_pool import HostExpertPool as P; "
                "p = P.attach(sys.argv[1]); print(float(p.gate_up.double().sum()), float(p.down.double().sum()))")
        out = subprocess.run([sys.executable, "-c", code, pool.name], capture_output=True, text=True, check=True)
        gu, dn = (float(v) for v in out.stdout.split())
        assert gu == float(pool.gate_up.double().sum()) and dn == float(pool.down.double().sum())
    finally:
        pool.close()
    with pytest.raises(FileNotFoundError):
        HostExpertPool.attach(pool.name)  # the owner's close removed the name


def test_crashed_owner_segment_is_cleaned_up_by_name():
    name = unique("crash")
    code = ("import os, sys, torch; from hearth.engine.experts.mechanism.host_pool import HostExpertPool as P; "
            "pool = P.create(sys.argv[1], (2, 4, 4), (2, 4, 2), torch.float32); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, name], check=True)
    if os.path.isdir("/dev/shm"):
        stale = [p for p in list_pools() if p["name"] == f"hearth-{name}"]
        assert stale and not stale[0]["owner_alive"]
    with pytest.raises(FileExistsError, match="hearth pool clean"):
        HostExpertPool.create(name, (2, 4, 4), (2, 4, 2), torch.float32)
    assert cleanup(name) is True and cleanup(name) is False


def random_tasks(seed: int, weight_dtype: torch.dtype, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    for t in (1, 1, 4, 7):
        x = torch.randn(t, H, generator=g).to(dtype)
        rows = torch.stack([torch.randperm(E_ROWS, generator=g)[:K] for _ in range(t)])
        rows[torch.rand(t, K, generator=g) < 0.3] = -1  # pairs served by the device
        weights = torch.softmax(torch.randn(t, K, generator=g), -1).to(weight_dtype)
        yield x, rows, weights


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
def test_worker_process_returns_same_partial_sums(dtype, weight_dtype):
    pool = filled_pool(unique("work"), dtype)
    ring = TaskRing.create(unique("ring"), RingLayout(slots=2, max_tokens=8, hidden=H, top_k=K))
    proc = subprocess.Popen([sys.executable, "-m", "hearth.engine.experts.mechanism.worker", "--pool", pool.name,
                             "--ring", ring.name, "--threads", "1"], stderr=subprocess.PIPE, text=True)
    local = CpuExpertWorkers(_PoolView(pool), activation("silu"), threaded=True)
    remote = RingCpuWorkers(ring, local.pool.expert_bytes, timeout_s=60)
    try:
        for x, rows, weights in random_tasks(1, weight_dtype, dtype):
            expected, _ = local.submit(x, rows, weights).result()
            got, timing = remote.submit(x, rows, weights).result()
            assert torch.equal(got, expected)
            assert timing.nbytes == int(torch.unique(rows[rows >= 0]).numel()) * local.pool.expert_bytes
        # Two tasks in flight at once (one per slot) come back in the right slots.
        tasks = list(random_tasks(2, weight_dtype, dtype))[:2]
        futures = [remote.submit(*task) for task in tasks]
        for fut, task in zip(futures, tasks, strict=True):
            assert torch.equal(fut.result()[0], local.submit(*task).result()[0])
    finally:
        remote.close()
        local.close()
        proc.wait(timeout=30)
        ring.close()
        pool.close()
    assert proc.returncode == 0


def test_engine_pool_in_shared_memory(checkpoint):
    from hearth.engine import LLM
    from tests.helpers import PROMPTS, greedy

    path, _ = checkpoint("qwen3_moe")
    name = unique("engine")
    llm = LLM(path, host_pool_name=name)
    assert llm.generate(PROMPTS[0], greedy(4))[0].token_ids == LLM(path).generate(PROMPTS[0], greedy(4))[0].token_ids
    with HostExpertPool.attach(name) as view:
        assert torch.equal(view.gate_up, llm.engine.pool.gate_up)
    llm.engine.close()
    with pytest.raises(FileNotFoundError):
        HostExpertPool.attach(name)


def test_owner_that_exits_without_close_removes_its_segment():
    name = unique("exit")
    code = ("import sys, torch; from hearth.engine.experts.mechanism.host_pool import HostExpertPool as P; "
            "pool = P.create(sys.argv[1], (2, 4, 4), (2, 4, 2), torch.float32)")
    subprocess.run([sys.executable, "-c", code, name], check=True)
    with pytest.raises(FileNotFoundError):
        HostExpertPool.attach(name)


def test_restarted_engine_reattaches_without_reading_experts(checkpoint, tmp_path):
    from hearth.engine import LLM
    from hearth.engine.checkpoint.dispatch import convert
    from hearth.engine.checkpoint.ftw import read_index
    from tests.helpers import PROMPTS, greedy

    src, _ = checkpoint("qwen3_moe")
    ftw = tmp_path / "ftw"
    convert(src, ftw)
    name = unique("restart")
    first = LLM(ftw, host_pool_name=name)
    expected = first.generate(PROMPTS[0], greedy(8))[0].token_ids
    # Damage the expert banks on disk: a re-attaching engine must not read them again.
    index = read_index(ftw)
    piece = index["banks"]["gate_up"][0]
    shard = ftw / index["shards"][piece["shard"]]["file"]
    data = bytearray(shard.read_bytes())
    data[piece["offset"] : piece["offset"] + 64] = bytes(64)
    shard.write_bytes(bytes(data))
    second = LLM(ftw, host_pool_name=name)
    assert not second.engine.host_pool.owner
    assert second.generate(PROMPTS[0], greedy(8))[0].token_ids == expected
    second.close()
    HostExpertPool.attach(name).close()  # still there: only the owner removes it
    first.close()
    with pytest.raises(FileNotFoundError):
        HostExpertPool.attach(name)


def test_half_filled_pool_is_refused(checkpoint, tmp_path):
    from hearth.engine import LLM
    from hearth.engine.config import ConfigError

    src, _ = checkpoint("qwen3_moe")
    name = unique("half")
    pool = HostExpertPool.create(name, (24, 64, 64), (24, 64, 32), torch.float32)  # never marked filled
    try:
        with pytest.raises(ConfigError, match="never completely filled"):
            LLM(src, host_pool_name=name)
    finally:
        pool.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)  # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_worker_process_exits_when_its_executor_dies():
    import time

    name = unique("orphan")
    code = ("import os, sys, torch; from hearth.engine.experts.mechanism.host_pool import HostExpertPool as P; "
            "from hearth.engine.experts.mechanism.ring import ProcessCpuWorkers, RingLayout; "
            "p = P.create(sys.argv[1], (2, 4, 4), (2, 4, 2), torch.float32); p.mark_filled(); "
            "w = ProcessCpuWorkers(p.name, RingLayout(1, 1, 4, 1), 100); "
            "print(w.process.pid, w.ring.name, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
    pid, ring_name = out.stdout.split()
    try:
        deadline = time.monotonic() + 20
        while not _gone(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(int(pid))
    finally:
        cleanup(name)
        cleanup(ring_name)
