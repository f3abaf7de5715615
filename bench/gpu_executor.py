"""GPU executor checks for ``bench/gpu_check.py``: the dense part, the KV cache and sampling on the
GPU, the experts through the hierarchy; plain and fixed-shape (graph) steps, elastic VRAM, speed
next to the bounds, and a small consumer GPU emulated by a VRAM limit. Each check reports what it
found and goes on, so that one run shows every failure.

Every check takes a :class:`Rig`: the GPU (the real check), or the CPU with the virtual expert
device and small sizes (``--cpu-dry-run``: the script's every path, run in CI, with no GPU
numbers)."""

from __future__ import annotations

import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

FRACTIONS = ("0slots", "0.1", "0.37", "1.0")
PROMPTS = [[5, 17, 33, 99, 100, 3, 7, 200, 201, 45], [300, 12, 12, 250, 8], list(range(40, 110)),
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301]]
GIB = 1 << 30
FULL_LAYERS = 48  # Qwen3-30B-A3B's layers: the emulation scales a GPU's memory to the layers built
QWEN3_30B_LAYER_EXPERT_BYTES = 128 * 3 * 2048 * 768 * 2  # its experts' bytes per layer (bf16)


@dataclass(frozen=True)
class Rig:
    """Where the checks run. ``dry``: on the CPU with the virtual expert device and small models,
    the fixed-shape step eager instead of captured, the GPU-only checks reported as skipped."""

    dry: bool = False

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def expert_device(self) -> str:
        return "virtual" if self.dry else "cuda"

    @property
    def fast_mode(self) -> str:
        """The fixed-shape mode compared with plain steps: CUDA graphs, or eager steps on the CPU."""
        return "eager" if self.dry else "graph"

    def llm(self, path: Path, mode: str = "off", **options):
        """An engine on this rig; the fixed-shape mode (graph, or eager on the dry run) puts the CPU
        experts behind the task ring (a worker process on a shared pool), which the GPU feeds itself."""
        from hearth.engine import LLM

        if mode == self.fast_mode:  # the dry run's eager steps too: the worker process starts as on a GPU
            options |= {"cpu_experts": "process", "host_pool_name": f"gpucheck-{uuid.uuid4().hex[:8]}"}
        return LLM(path, device=self.device, expert_device=self.expert_device, static_decode=mode, **options)

    def synchronize(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()


def guarded(name: str, fn, *args) -> dict:
    """fn(*args) as a report row; an exception becomes the row's error (with its last frames)."""
    start = time.time()
    try:
        out = fn(*args)
        row = out if isinstance(out, dict) else {"result": out}
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - a failed check is reported, the run goes on; BaseException
        # too, since pytest's skip (raised by a helper's importorskip) is one and would end the whole run
        row = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
               "where": traceback.format_exc().splitlines()[-6:]}
    row["check"], row["seconds"] = name, round(time.time() - start, 1)
    return row


def skipped(name: str, why: str) -> dict:
    return {"check": name, "seconds": 0.0, "ok": None, "skipped": why}


def run(llm, prompts: list[list[int]], steps: int):
    """Greedy tokens and fp32 logits (on the host) of ``prompts``, ``steps`` tokens each."""
    from hearth.engine import SamplingParams
    from tests.checkpoints import record_logits

    recorded = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs], [torch.stack(recorded[o.request_id]).float().cpu() for o in outs]


def compare(tokens, logits, ref, fp32: bool, tolerance: float = 1e-4) -> dict:
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref[1], strict=True))
    equal = tokens == ref[0]
    return {"tokens_equal": equal, "max_rel_error": err, "ok": equal and (not fp32 or err <= tolerance)}


def check_exactness(rig: Rig, root: Path) -> list[dict]:
    """Dense on the device, experts through the hierarchy at each cache fraction, plain steps and
    captured fixed-shape steps: fp32 against the CPU engine without a hierarchy (logits within
    1e-4), bf16 against plain steps on the same device and split (tokens equal: the GPU's cuBLAS
    and inductor round bf16 differently from the CPU's kernels, so only the device's own eager
    path is a fair bf16 reference); a plain family (Qwen3-MoE, fp32 and bf16) and a hybrid one
    (Qwen3-Next). Prompts and steps keep every step in one block-table width, so each engine
    captures few graphs."""
    from hearth.engine import LLM
    from tests.checkpoints import make_checkpoint

    rows = []
    for family, dtype in (("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("qwen3_next", "float32")):
        path = root / f"exec-{family}-{dtype}"
        make_checkpoint(path, family, "per_expert", dtype, num_experts=16, num_experts_per_tok=4)
        cpu_ref = run(LLM(path, device="cpu", expert_device="none", max_model_len=128), PROMPTS, 32)
        for fraction in FRACTIONS:
            device_ref: list = []  # bf16: this fraction's plain steps on the device, the reference of its graph steps
            for mode in ("off", rig.fast_mode):
                def one(path=path, fraction=fraction, mode=mode, dtype=dtype, cpu_ref=cpu_ref, device_ref=device_ref):
                    ref = cpu_ref if dtype == "float32" or mode == "off" else device_ref[0]
                    llm = rig.llm(path, mode, expert_cache=fraction, max_model_len=128)
                    tokens, logits = run(llm, PROMPTS, 32)
                    device_ref.append((tokens, logits))
                    # bf16 plain steps against the CPU engine: reported, not judged (rounding differs).
                    row = compare(tokens, logits, ref, dtype == "float32")
                    if dtype != "float32" and mode == "off":
                        row["ok"] = None
                    static = llm.engine.runner.static
                    row["static_steps"] = static.steps if static is not None else 0
                    llm.close()
                    return row
                rows.append(guarded(f"exact {family} {dtype} cache={fraction} static={mode}", one)
                            | {"family": family, "dtype": dtype, "fraction": fraction, "static": mode})
    return rows


NEW_FAMILIES = ("olmoe", "glm4_moe", "deepseek_v3", "deepseek_v2", "minimax_m2", "gpt_oss", "deepseek_v4")


def check_families(rig: Rig, root: Path) -> list[dict]:
    """Every family beyond the first five on the device, plain steps, the experts through the
    hierarchy at cache fraction 0.37, against the CPU engine: fp32 logits within 1e-4."""
    from hearth.engine import LLM
    from tests.checkpoints import make_checkpoint

    rows = []
    for family in NEW_FAMILIES:
        def one(family=family):
            path = root / f"family-{family}"
            make_checkpoint(path, family, "per_expert", "float32", num_experts_per_tok=4)
            ref = run(LLM(path, device="cpu", expert_device="none", max_model_len=128), PROMPTS, 16)
            llm = rig.llm(path, expert_cache="0.37", max_model_len=128)
            row = compare(*run(llm, PROMPTS, 16), ref, True)
            llm.close()
            return row
        rows.append(guarded(f"family {family} on the device", one) | {"family": family})
    return rows


def check_sync_free(rig: Rig, root: Path) -> dict:
    """Host synchronisations inside captured fixed-shape steps, caught by torch's sync debug mode
    (error): the fill reads its count on the device, the CPU share goes through the task ring."""
    if rig.dry:
        return skipped("no host sync inside a captured step", "needs CUDA (the CPU proof is tests/test_static_decode)")
    llm = rig.llm(root / "exec-qwen3_moe-float32", "graph", expert_cache="0.37", max_model_len=128)
    run(llm, PROMPTS, 4)  # compiled and captured
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(llm, PROMPTS[:1], 4)
        found = None
    except RuntimeError as exc:
        found = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        llm.close()
    return {"ok": found is None, "sync_inside_step": found}


def read_rate(rig: Rig) -> float:
    """The device's memory bandwidth in bytes/s (a large copy reads and writes it)."""
    n = 64 << 20 if rig.dry else 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=rig.device)
    b = torch.empty_like(a)
    b.copy_(a)
    rig.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    rig.synchronize()
    return 2 * 10 * n / (time.perf_counter() - start)


def model_1b(rig: Rig, root: Path) -> Path:
    """The ~1B random Qwen3-MoE (bf16) of the speed checks; a small one on the dry run."""
    from tests.checkpoints import make_checkpoint

    path = root / "exec-1b"
    if not path.exists():
        size = (dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512,
                     vocab_size=4096) if rig.dry else
                dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                     intermediate_size=2048, vocab_size=32000))
        make_checkpoint(path, "qwen3_moe", "fused", "bfloat16", shard_bytes=1 << 30, **size)
    return path


def decode_speed(rig: Rig, llm, tokens: int, bandwidth: float) -> dict:
    """Decode tok/s at batch 1 next to the model bound: the largest of (dense + cached expert bytes)
    / device bandwidth, filled bytes / B_P and CPU-expert bytes / B_R (B_R = B_H - B_P: the host's
    reads left while the link copies; B_H where nothing is filled)."""
    from hearth.engine import SamplingParams
    from hearth.engine.executor.memory_plan import tensor_bytes

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPTS[2]], params)  # warm (compiled, captured)
    before = llm.engine.stats()["experts"]
    start = time.perf_counter()
    llm.generate([PROMPTS[2]], params)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()["experts"]
    model = llm.engine.runner.model
    dense = tensor_bytes([*model.parameters(), *model.buffers()], llm.engine.device)  # on the executor's device
    filled = (after["fill_bytes"] - before["fill_bytes"]) / tokens
    cpu = (after["cpu_bytes"] - before["cpu_bytes"]) / tokens
    hits = (after["hits"] - before["hits"]) * after["expert_bytes"] / tokens
    b_p, b_h = after.get("b_p") or float("inf"), after.get("b_h") or float("inf")
    b_r = b_h - b_p if filled and b_h > b_p else b_h
    bound = max((dense + hits) / bandwidth, filled / b_p, cpu / b_r)
    return {"tok_s": tokens / seconds, "bound_tok_s": 1 / bound, "share": tokens / seconds * bound,
            "slots": after["slots"], "dense_bytes": dense, "hit_bytes": hits, "fill_bytes": filled,
            "cpu_bytes": cpu, "ok": True}


def check_speed(rig: Rig, root: Path) -> list[dict]:
    """Decode tok/s of the ~1B random Qwen3-MoE at batch 1 at each cache fraction, plain and
    captured steps, next to the model bound."""
    path = model_1b(rig, root)
    bandwidth = read_rate(rig)
    rows = []
    for fraction in FRACTIONS:
        for mode in ("off", rig.fast_mode):
            def one(fraction=fraction, mode=mode):
                llm = rig.llm(path, mode, expert_cache=fraction, max_model_len=512)
                row = decode_speed(rig, llm, 16 if rig.dry else 64, bandwidth)
                llm.close()
                return row
            rows.append(guarded(f"speed cache={fraction} static={mode}", one)
                        | {"fraction": fraction, "static": mode, "device_GBps": bandwidth / 1e9})
    return rows


def check_emulation(rig: Rig, shapes: Path, layers: int) -> list[dict]:
    """A consumer GPU of 8 and 24 GB running Qwen3-30B-A3B, emulated: the real-shape model of
    ``layers`` layers under a VRAM limit scaled by layers / 48, so that its cache holds the share
    of the experts the whole model would get; tok/s also scaled back to 48 layers."""
    import json

    cfg = json.loads((shapes / "config.json").read_text())
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    layer_bytes = experts * 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2
    # The dry run's smaller experts scale the GPU down further, to the same share of the experts.
    scale = layers / FULL_LAYERS * layer_bytes / QWEN3_30B_LAYER_EXPERT_BYTES
    bandwidth = read_rate(rig)
    rows = []
    for gb in (8, 24):
        def one(gb=gb):
            llm = rig.llm(shapes, rig.fast_mode, vram_limit=int(gb * GIB * scale), max_model_len=512, max_num_seqs=1)
            experts = llm.engine.experts
            row = decode_speed(rig, llm, 8 if rig.dry else 32, bandwidth)
            row["cache_fraction"] = experts.tables.num_slots / llm.engine.pool.gate_up.shape[0]
            row["full_model_tok_s"] = row["tok_s"] * layers / FULL_LAYERS
            llm.close()
            return row
        rows.append(guarded(f"emulated {gb} GB GPU", one) | {"vram_gb": gb, "layers": layers})
    return rows


def check_prefill(rig: Rig, root: Path) -> list[dict]:
    """Prefill tok/s at 4k and 16k tokens (chunks of 4k, whole layers streamed on the copy stream)
    next to the PCIe bound: each chunk moves every expert that is not resident across the link."""
    from hearth.engine import SamplingParams

    path = model_1b(rig, root)
    chunk = 128 if rig.dry else 4096
    rows = []
    for n in ((256, 512) if rig.dry else (4096, 16384)):
        def one(n=n):
            llm = rig.llm(path, expert_cache="0.37", max_model_len=n + 64, prefill_chunk=chunk)
            prompt = [(i * 31) % 4000 + 3 for i in range(n)]
            params = SamplingParams(max_tokens=1, temperature=0)
            llm.generate([prompt[: chunk + 8]], params)  # warm: one streamed chunk
            start = time.perf_counter()
            llm.generate([prompt], params)
            seconds = time.perf_counter() - start
            stats = llm.engine.stats()["experts"]
            pool = llm.engine.pool
            # Resident experts do not cross: the slots past the streaming buffers' (a layer each).
            buffers = stats.get("prefill_buffers", 0) * pool.num_experts
            crossing = pool.nbytes * (1 - max(stats["slots"] - buffers, 0) / pool.gate_up.shape[0])
            bound = -(-n // chunk) * crossing / (stats.get("b_p") or float("inf"))
            llm.close()
            return {"tok_s": n / seconds, "pcie_bound_tok_s": n / bound if bound else None,
                    "share": bound / seconds, "streamed_steps": stats.get("prefill_streamed_steps", 0),
                    "hidden_share": stats.get("prefill_hidden_share"), "ok": True}
        rows.append(guarded(f"prefill {n}", one) | {"tokens": n})
    return rows


def check_elastic(rig: Rig, root: Path) -> dict:
    """Resize the cache between decode steps on the device: tokens as without, memory given back."""
    from hearth.engine import LLM
    from tests.helpers import run_resizing

    path = root / "exec-qwen3_moe-float32"
    ref = run_resizing(LLM(path, device="cpu", expert_device="none"), PROMPTS, 24, {})
    llm = rig.llm(path, expert_cache="1.0")
    reserved = [0 if rig.dry else torch.cuda.memory_reserved()]
    tokens, logits = run_resizing(llm, PROMPTS, 24, {4: "0.1", 10: "0slots", 16: "1.0"})
    reserved.append(0 if rig.dry else torch.cuda.memory_reserved())
    llm.engine.resize_expert_cache("0slots")
    reserved.append(0 if rig.dry else torch.cuda.memory_reserved())
    llm.close()
    row = compare(tokens, [x.float().cpu() for x in logits], ref, True)
    row["reserved_bytes"] = reserved
    row["ok"] = row["ok"] and reserved[2] <= reserved[1]
    return row
