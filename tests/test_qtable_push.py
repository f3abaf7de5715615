"""q* in the graph (CPU stand-in): the cache-control step compiled with ``torch.compile(fullgraph=True)``
reads the q table as a tensor. New bandwidths pushed by the monitor are written into that tensor in
place, and the very next decode step splits differently: no recompilation, no new tables, no new
arena, and the tokens stay those of the plain engine."""

from __future__ import annotations

import pytest
import torch

from hearth.engine import LLM
from hearth.engine.experts.policy.cache import cache_step
from tests.helpers import PROMPTS, greedy
from tests.test_hierarchy import OVERRIDES

FILL_ALL = (100e9, 1e9)  # a fast link, a slow CPU: every miss is filled
CPU_ALL = (1e6, 25e9)  # a crawling link: every miss is computed on the CPU


def test_pushed_qtable_changes_the_next_step_without_recompiling(checkpoint) -> None:
    dynamo = pytest.importorskip("torch._dynamo.testing")
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    plain = LLM(path, expert_device="none")
    expected = plain.generate(PROMPTS[:1], greedy(16))[0].token_ids
    plain.close()

    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="step", expert_bandwidths=FILL_ALL,
              stream_min_tokens=1 << 20)
    engine, backend = llm.engine, llm.engine.experts
    counter = dynamo.CompileCounter()
    backend.tables.step_fn = torch.compile(cache_step, backend=counter, fullgraph=True, dynamic=False)
    qtable, tables, arena = backend.tables.qtable, backend.tables, backend.device.gate_up
    assert qtable.tolist() == list(range(qtable.numel()))  # q = m: fill every miss

    engine.add_request(PROMPTS[0], greedy(16))
    tokens: list[int] = []
    split: list[tuple[int, int]] = []  # (fills, CPU experts) of each step

    def step() -> None:
        before = backend.stats()
        for out in engine.step():
            tokens.extend(out.chunk.token_ids)
        after = backend.stats()
        split.append((after["fills"] - before["fills"], after["cpu"] - before["cpu"]))

    for _ in range(8):  # the prompt, then decode steps of one token each
        step()
    compiled = counter.frame_count  # the prompt's shape and the decode shape
    assert compiled >= 1
    assert sum(f for f, _ in split[1:]) > 0 and sum(c for _, c in split[1:]) == 0

    backend.set_bandwidths(*CPU_ALL)  # what the monitor does between two steps
    assert backend.qtable() == [0] * qtable.numel()
    pushed_at = len(split)
    while engine.has_unfinished():
        step()
    after = split[pushed_at:]
    assert after[0][0] == 0 and after[0][1] > 0  # the very next step: every miss on the CPU
    assert all(f == 0 for f, _ in after) and sum(c for _, c in after) > 0
    assert counter.frame_count == compiled  # the compiled step was not rebuilt
    assert backend.tables is tables and tables.qtable is qtable and backend.device.gate_up is arena
    assert tokens == expected
    llm.close()


def test_a_tuned_credit_reaches_the_compiled_step_in_place(checkpoint) -> None:
    """Fixed-shape steps feed the fill-credit tuner whole steps (observe_step); when it moves the
    credit, the q table is rewritten in the tensor the compiled step reads."""
    path, _ = checkpoint("qwen3_moe", **OVERRIDES)
    llm = LLM(path, expert_device="virtual", expert_cache="0.37", q_mode="table", expert_bandwidths=(10e9, 25e9),
              stream_min_tokens=1 << 20, static_decode="eager")
    backend = llm.engine.experts
    qtable, before = backend.tables.qtable, backend.qtable()
    assert llm.engine.runner.static.on_step == backend.observe_step
    backend.tuner.index = backend.tuner.ladder.index(float("inf"))  # the tuner settles on filling every miss
    backend.tuner.observe = lambda seconds, calls: True
    backend.observe_step(0.01, 1)
    assert backend.tables.qtable is qtable and backend.qtable() == list(range(len(before))) != before
    llm.close()
