"""Row e of the GPU contact check: elastic VRAM against a real neighbour.

Another process takes GPU memory while the engine decodes; the VRAM watcher, reading the GPU's
free memory through NVML as in ``hearth serve``, shrinks the expert cache between steps; the
neighbour frees its memory and the cache grows back to its starting size. Tokens and logits stay
those of the CPU engine throughout. On the dry run a scripted reading stands in for NVML and the
neighbour.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch

from bench import gpu_executor as ex

TAKE_AT, FREE_AT, TOKENS = 4, 10, 24


def gpu_neighbour(conn) -> None:
    """The other program: holds GPU memory on request ("take", bytes) and frees it ("free")."""
    held = torch.empty(1, device="cuda")  # its context first, so the readings after it are steady
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "take":
            held = torch.empty(msg[1], dtype=torch.uint8, device="cuda")
        elif msg[0] == "free":
            del held
            held = None
            torch.cuda.empty_cache()
        else:
            return
        torch.cuda.synchronize()
        conn.send("done")


class Neighbour:
    """A process on the same GPU (or, on the dry run, a scripted free-memory reading)."""

    def __init__(self, dry: bool, start_free: int = 0) -> None:
        self.dry, self.free_now = dry, start_free
        if not dry:
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=gpu_neighbour, args=(child,), daemon=True)
            self.proc.start()
            if not self.conn.poll(120) or self.conn.recv() != "ready":
                raise TimeoutError("the neighbour process did not start on the GPU")

    def reader(self):
        """The watcher's free-memory reading: NVML on a GPU."""
        if self.dry:
            return lambda: self.free_now
        from hearth.engine.experts.mechanism.vram_watch import nvml_free_reader

        read = nvml_free_reader(torch.cuda.current_device())
        if read is None:
            raise RuntimeError("NVML cannot read this GPU's free memory (pynvml missing?)")
        return read

    def take(self, nbytes: int) -> None:
        self._ask(("take", nbytes), -nbytes)

    def give_back(self, nbytes: int) -> None:
        self._ask(("free",), nbytes)

    def _ask(self, msg: tuple, change: int) -> None:
        if self.dry:
            self.free_now += change
            return
        self.conn.send(msg)
        if not self.conn.poll(60) or self.conn.recv() != "done":
            raise TimeoutError(f"the neighbour process did not answer {msg[0]}")

    def close(self) -> None:
        if not self.dry:
            self.conn.send(("quit",))
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


def check_elastic(rig: ex.Rig, root: Path) -> dict:
    """Decode 4 prompts; before step TAKE_AT the neighbour takes what leaves the cache about half
    its size and the watcher checks; before step FREE_AT it frees it and the watcher checks again."""
    from hearth.engine import LLM
    from hearth.engine.experts.mechanism.vram_watch import VramWatcher
    from hearth.engine.experts.policy.vram import VramPolicy
    from tests.checkpoints import make_checkpoint

    path = root / "elastic"
    size = {} if rig.dry else {"hidden_size": 1024, "moe_intermediate_size": 1024, "num_hidden_layers": 4}
    make_checkpoint(path, "qwen3_moe", "per_expert", "float32", num_experts=16, num_experts_per_tok=4, **size)
    ref = ex.run(LLM(path, device="cpu", expert_device="none", max_model_len=128), ex.PROMPTS, TOKENS)
    llm = rig.llm(path, "off", expert_cache="1.0", max_model_len=128)
    engine, experts = llm.engine, llm.engine.experts
    slot = experts.pool.expert_bytes
    ceiling = experts.tables.num_slots * slot
    # The policy leaves the cache's own size free for others: taking all but half of that leaves the
    # cache half of its size, and the neighbour never asks for more than is free.
    reserve = ceiling
    neighbour = None
    try:
        neighbour = Neighbour(rig.dry, start_free=reserve + (1 << 30))
        read = neighbour.reader()
        watcher = VramWatcher(read, lambda: experts.tables.num_slots * slot,
                              lambda n: engine.resize_expert_cache(f"{n}b"),
                              VramPolicy(reserve, ceiling, slot, grow_step=max(ceiling // 16, 1)), interval_s=3600)
        taken = [0]
        sizes: list[int] = [experts.tables.num_slots]

        def take() -> None:
            # Read now, between steps: what the engine's first steps allocated (workspaces, kernels) counts.
            taken[0] = max(read() - reserve + ceiling // 2, 0)
            neighbour.take(taken[0])
            watcher.check()
            sizes.append(experts.tables.num_slots)

        def give_back() -> None:
            neighbour.give_back(taken[0])
            watcher.check()
            sizes.append(experts.tables.num_slots)

        tokens, logits = decode_with_events(llm, {TAKE_AT: take, FREE_AT: give_back})
    finally:
        if neighbour is not None:
            neighbour.close()
        llm.close()
    row = ex.compare(tokens, logits, ref, True)
    shrank, grew = sizes[1] < sizes[0], sizes[2] == sizes[0]
    return row | {"slots": sizes, "taken_bytes": taken[0], "shrank": shrank, "grew_back": grew,
                  "ok": row["ok"] and shrank and grew}


def decode_with_events(llm, events: dict) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding of ex.PROMPTS stepping the engine by hand, calling ``events[step]`` before
    those steps; (tokens, fp32 logits on the host) per prompt."""
    from tests.helpers import greedy, record_logits

    engine = llm.engine
    recorded = record_logits(llm)
    ids = [engine.add_request(p, greedy(TOKENS)) for p in ex.PROMPTS]
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    for step in range(10 * TOKENS):  # bounded: prefill and decode of every prompt take far fewer
        if not engine.has_unfinished():
            break
        if step in events:
            events[step]()
        for output in engine.step():
            out[output.request_id] += output.chunk.token_ids
    return [out[rid] for rid in ids], [torch.stack(recorded[rid]).float().cpu() for rid in ids]
