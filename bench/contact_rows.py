"""The rows of the GPU contact check (``bench/contact.py`` runs each in its own process).

Each ``row_<name>(rig, record)`` makes its checks in order of importance and hands each result to
``record`` as soon as it is known (a dict with ``check`` and ``ok``: True, False, or None for a
figure or a skip). A check that raises becomes a failed row with its error, and the row goes on.
On the dry run (``rig.dry``) the same code runs on the CPU: the virtual expert device, Triton's
interpreter for the kernels, small models, fixed-shape steps eager.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from bench import gpu_executor as ex
from bench.gpu_executor import Rig, guarded

Record = Callable[[dict], None]
EXACT_TOKENS = 24
__all__ = ["Rig", "row_cuda", "row_exact", "row_shape", "row_elastic", "row_families"]


def scratch() -> Path:
    """A scratch folder for the row's checkpoints, removed when the process ends."""
    path = Path(tempfile.mkdtemp(prefix="hearth-contact-"))
    import atexit

    atexit.register(shutil.rmtree, path, True)
    return path


# -- a. CUDA facts and the kernels ---------------------------------------------------------------
def row_cuda(rig: Rig, record: Record) -> None:
    if rig.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels are built on first use: the interpreter runs them
    record(guarded("facts", facts, rig))
    record(guarded("fill kernel against torch", check_fill_kernel, rig))
    record(guarded("expert kernels against torch", check_expert_kernels, rig))
    record(guarded("ring kernels with a CPU worker process", check_ring_kernels, rig))


def facts(rig: Rig) -> dict:
    """What the machine is: GPU, driver, library versions, host memory, /dev/shm, the CPU kernels."""
    import transformers

    from hearth.engine.kernels.cpu import cpu_decode_ops

    out: dict = {"ok": None, "python": platform.python_version(), "torch": torch.__version__,
                 "transformers": transformers.__version__, "cpus": os.cpu_count(),
                 "host_memory_GiB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                 "dev_shm_GiB": round(shutil.disk_usage("/dev/shm").total / 2**30, 1) if Path("/dev/shm").exists()
                 else None, "cpu_kernels": _cpu_kernels(cpu_decode_ops()), "commit": os.environ.get("HEARTH_COMMIT")}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if rig.dry:
        return out
    props = torch.cuda.get_device_properties(0)
    out |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "gpu_memory_GiB": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
            "driver": _driver_version()}
    out["device_copy_GBps"] = ex.read_rate(rig) / 1e9
    out["h2d_pinned_GBps"] = _h2d_rate()
    return out


def _cpu_kernels(ops) -> str:
    return "none (torch paths)" if ops is None else ops._decode.__name__.rsplit(".", 1)[-1]


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - a fact, not a check
        return None


def _h2d_rate(nbytes: int = 1 << 30) -> float:
    """Pinned host -> device copy rate (the DMA path), GB/s."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - start) / 1e9


def _mapped(host: torch.Tensor, rig: Rig) -> tuple[torch.Tensor, Callable[[], None]]:
    """``host`` as the GPU reads it in place (registered, mapped), and how to unregister it; the
    tensor itself on the dry run."""
    if rig.dry:
        return host, lambda: None
    from hearth.engine.experts.mechanism.device import pin_host_memory
    from hearth.engine.kernels.gpu.device_fill import mapped_view

    pointers = pin_host_memory([host])

    def release() -> None:
        torch.cuda.synchronize()
        for ptr in pointers:
            torch.cuda.cudart().cudaHostUnregister(ptr)
    return mapped_view(host, "cuda"), release


def check_fill_kernel(rig: Rig) -> dict:
    """The count-aware fill from mapped host memory: exactly ``count`` rows land in their slots, the
    rest stay as they were; then its rate on experts of Qwen3-30B-A3B's size (the SM-load path
    that graph mode fills through)."""
    from hearth.engine.kernels.gpu import device_fill

    g = torch.Generator().manual_seed(0)
    rows, row_shape = (24, (3, 40)) if rig.dry else (64, (3 * 768, 2048))
    bank = torch.randn((rows, *row_shape), generator=g).to(torch.bfloat16)
    src_bank, release = _mapped(bank, rig)
    try:
        slots = torch.full((8, *row_shape), -7.0, dtype=torch.bfloat16, device=rig.device)
        table = torch.randperm(rows, generator=g).to(rig.device)
        src, dst = torch.tensor([5, 1, 9, 3, 2, 0]), torch.tensor([7, 0, 3, 5, 1, 2])
        count = torch.tensor([4])
        device_fill.fill_rows(slots, src_bank, table, src.to(rig.device), dst.to(rig.device), count.to(rig.device))
        want = torch.full_like(slots.cpu(), -7.0)
        want[dst[:4]] = bank[table.cpu()[src[:4]]]
        exact = torch.equal(slots.cpu(), want)
        out = {"ok": exact, "exact": exact}
        if not rig.dry:
            out["mapped_fill_GBps"] = _fill_rate(src_bank, table, bank[0].nbytes)
    finally:
        release()
    return out


def _fill_rate(src_bank: torch.Tensor, table: torch.Tensor, row_bytes: int, fills: int = 32) -> float:
    from hearth.engine.kernels.gpu import device_fill

    slots = torch.empty((fills, *src_bank.shape[1:]), dtype=src_bank.dtype, device="cuda")
    ids = torch.arange(fills, device="cuda") % src_bank.shape[0]
    dst, count = torch.arange(fills, device="cuda"), torch.tensor([fills], device="cuda")
    device_fill.fill_rows(slots, src_bank, table, ids, dst, count)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        device_fill.fill_rows(slots, src_bank, table, ids, dst, count)
    torch.cuda.synchronize()
    return 5 * fills * row_bytes / (time.perf_counter() - start) / 1e9


def check_expert_kernels(rig: Rig) -> dict:
    """The slot-expert kernels (up and down) against the eager partial sum, fp32 and bf16, batch 1
    and 4, with pairs served elsewhere (-1) among them."""
    from hearth.engine.experts.compute import routed_partial_sum
    from hearth.engine.kernels.gpu import device_experts

    g = torch.Generator().manual_seed(1)
    hidden, inter, slots, k = (64, 32, 6, 4) if rig.dry else (2048, 768, 32, 8)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(slots, 2 * inter, hidden, generator=g) * 0.05).to(dtype).to(rig.device)
        down = (torch.randn(slots, hidden, inter, generator=g) * 0.05).to(dtype).to(rig.device)
        for t in (1, 4):
            x = torch.randn(t, hidden, generator=g).to(dtype).to(rig.device)
            pair = torch.randint(-1, slots, (t, k), generator=g).to(rig.device)
            weights = torch.rand(t, k, generator=g).to(rig.device)
            ours = device_experts.slot_experts(x, gate_up, down, pair, weights)
            ref = routed_partial_sum(x, gate_up, down, pair, weights, torch.nn.functional.silu)
            errors[f"{str(dtype)[6:]} batch={t}"] = float((ours - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
    # fp32 to 1e-4; bf16 intermediates are rounded in different places by the two paths.
    ok = all(e <= (1e-4 if name.startswith("float32") else 2e-2) for name, e in errors.items())
    return {"ok": ok, "max_rel_error": errors}


def serve_ring(name: str, tasks: int, deadline_s: float) -> None:
    """A CPU worker process on ``name``'s slot 0: answers ``tasks`` tasks with 2 * x."""
    from hearth.engine.experts.mechanism.ring import TaskRing
    from hearth.engine.kernels.ring_words import DONE, SUBMITTED

    ring = TaskRing.attach(name)
    slot, hidden, end = ring.slots[0], ring.layout.hidden, time.monotonic() + deadline_s
    for _ in range(tasks):
        while int(slot["ctrl"][0]) != SUBMITTED:
            if time.monotonic() > end:
                return
        t = int(slot["ctrl"][2])
        slot["out"][: t * hidden].copy_(slot["x"][: t * hidden] * 2)
        slot["ctrl"][0] = DONE


def check_ring_kernels(rig: Rig) -> dict:
    """Post and collect through the shared task ring from the device, a worker process answering:
    the partial sum comes back exact and the slot is free again; then the round trip's time."""
    from hearth.engine.experts.mechanism.ring import RingLayout, TaskRing
    from hearth.engine.kernels.gpu import device_ring
    from hearth.engine.kernels.ring_words import FREE

    layout = RingLayout(slots=1, max_tokens=4, hidden=256, top_k=8)
    ring = TaskRing.create(f"contact-{uuid.uuid4().hex[:8]}", layout)
    rounds = 3 if rig.dry else 200
    worker = multiprocessing.get_context("spawn").Process(target=serve_ring, args=(ring.name, rounds, 120))
    worker.start()
    whole = torch.frombuffer(ring.segment.buf, dtype=torch.uint8)
    _, release = _mapped(whole, rig)
    try:
        slot = ring.slots[0] if rig.dry else _device_slot(ring)
        x = torch.randn(4, 256).to(torch.bfloat16).to(rig.device)
        rows = torch.tensor([[3, -1, 5, 7, -1, 1, 2, 0]] * 4, device=rig.device)
        weights = torch.rand(4, 8, device=rig.device)
        out = torch.empty(4, 256, device=rig.device)
        times, exact = [], True
        for _ in range(rounds):
            start = time.perf_counter()
            device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, rows, weights)
            device_ring.collect(slot["ctrl"], slot["out"], out, 10**7)
            rig.synchronize()
            times.append(time.perf_counter() - start)
            exact &= torch.equal(out.cpu(), x.float().cpu() * 2)
        device_ring.raise_if_failed(ring.slots[0]["ctrl"])
        free = int(ring.slots[0]["ctrl"][0]) == FREE
        # A share with no rows (every pair on the device): nothing posted, zeros back, no round trip.
        start = time.perf_counter()
        device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, torch.full_like(rows, -1), weights)
        device_ring.collect(slot["ctrl"], slot["out"], out, 10**7)
        rig.synchronize()
        empty_us = (time.perf_counter() - start) * 1e6
        empty_ok = bool((out == 0).all()) and int(ring.slots[0]["ctrl"][0]) == FREE
    finally:
        release()
        worker.join(30)
        ring.close()
    return {"ok": exact and free and empty_ok, "exact": exact, "slot_free_after": free, "empty_share_ok": empty_ok,
            "round_trip_us_median": sorted(times)[len(times) // 2] * 1e6, "empty_share_us": empty_us}


def _device_slot(ring) -> dict[str, torch.Tensor]:
    from hearth.engine.kernels.gpu.device_fill import mapped_view

    return {name: mapped_view(t, "cuda") for name, t in ring.slots[0].items()}


# -- b. the executor against the CPU engine ---------------------------------------------------
def row_exact(rig: Rig, record: Record) -> None:
    """fp32 on the device against the CPU engine at 0 slots, 0.37 and all of the experts, plain and
    fixed-shape steps (graphs on a GPU: no skipped capture, no host sync in the replay); bf16
    fixed-shape steps against plain steps on the same device and split."""
    from hearth.engine import LLM
    from tests.checkpoints import make_checkpoint

    root = scratch()
    path = root / "fp32"
    make_checkpoint(path, "qwen3_moe", "per_expert", "float32", num_experts=16, num_experts_per_tok=4)
    ref = ex.run(LLM(path, device="cpu", expert_device="none", max_model_len=128), ex.PROMPTS, EXACT_TOKENS)
    bf16 = root / "bf16"
    make_checkpoint(bf16, "qwen3_moe", "per_expert", "bfloat16", num_experts=16, num_experts_per_tok=4)

    def fp32(fraction: str) -> None:
        for mode in ("off", rig.fast_mode):
            record(guarded(f"exact float32 cache={fraction} static={mode}", exact_one, rig, path, fraction, mode,
                           ref, True) | {"fraction": fraction, "static": mode})

    def bf16_graph(fraction: str) -> None:
        def one() -> dict:
            eager = rig.llm(bf16, "off", expert_cache=fraction, max_model_len=128)
            reference = ex.run(eager, ex.PROMPTS, EXACT_TOKENS)
            eager.close()
            return exact_one(rig, bf16, fraction, rig.fast_mode, reference, False) | {"reference": "device eager"}
        record(guarded(f"exact bfloat16 cache={fraction} static={rig.fast_mode} vs device eager", one)
               | {"fraction": fraction, "static": rig.fast_mode})

    # Each fixed-shape engine compiles (captures) its step once: most telling first, in case the
    # row's budget runs out.
    for part in (lambda: fp32("1.0"), lambda: fp32("0.37"), lambda: bf16_graph("0.37"), lambda: fp32("0slots"),
                 lambda: bf16_graph("1.0")):
        part()


def exact_one(rig: Rig, path: Path, fraction: str, mode: str, ref, fp32: bool) -> dict:
    """One engine against ``ref``; for fixed-shape steps also the compiled steps' graph skips and,
    on a GPU, a few more tokens with host syncs made errors around the replay alone."""
    llm = rig.llm(path, mode, expert_cache=fraction, max_model_len=128)
    try:
        row = ex.compare(*ex.run(llm, ex.PROMPTS, EXACT_TOKENS), ref, fp32)
        static = llm.engine.runner.static
        if static is not None:
            row["static_steps"] = static.steps
            row["graph_skips"] = getattr(static, "graph_skips", None)
            if mode == "graph":
                row["sync_in_replay"], row["replays_checked"] = replay_syncs(llm)
                row["ok"] = row["ok"] and row["graph_skips"] == 0 and row["sync_in_replay"] is None \
                    and row["replays_checked"] > 0
        return row
    finally:
        llm.close()


def replay_syncs(llm) -> tuple[str | None, int]:
    """Decode one prompt with the fixed-shape step's replays guarded against host syncs (the
    decoder's ``sync_check``: a bucket's calls after its warm-up and recording); the first sync's
    message or None, and how many replays were checked."""
    static = llm.engine.runner.static
    before = static.replays_checked
    static.sync_check = True
    try:
        ex.run(llm, ex.PROMPTS, 12)  # the bucket the exactness run captured: every step a replay
        found = None
    except RuntimeError as exc:
        found = str(exc).splitlines()[0]
    finally:
        static.sync_check = False
    return found, static.replays_checked - before


# -- e. elastic VRAM -----------------------------------------------------------------------------
def row_elastic(rig: Rig, record: Record) -> None:
    from bench.contact_elastic import check_elastic

    record(guarded("elastic VRAM with another process", check_elastic, rig, scratch()))


# -- f. the other families --------------------------------------------------------------------
def row_families(rig: Rig, record: Record) -> None:
    for row in ex.check_families(rig, scratch()):
        record(row)


# -- c, d. the Qwen3-30B-A3B shape -----------------------------------------------------------
def row_shape(rig: Rig, record: Record) -> None:
    from bench.contact_shape import run_shape

    run_shape(rig, record)


if __name__ == "__main__":  # pragma: no cover - rows run through bench/contact.py
    sys.exit("run bench/contact.py")
