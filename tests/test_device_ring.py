"""The ring kernels of captured decode steps (engine/kernels/gpu/device_ring.py), run by Triton's
interpreter on the CPU against a worker thread standing in for the CPU expert worker: the posted
descriptor is what the eager ring client writes, the collect waits for the completion word and
frees the slot, and a dead worker (timeout) or a failed task leaves zeros and an error for the host."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from hearth.engine.experts.mechanism.ring import RingLayout, TaskRing
from hearth.engine.kernels.gpu import device_ring
from hearth.engine.kernels.ring_words import DONE, FAILED, FREE, SUBMITTED


@pytest.fixture
def kernels(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return device_ring.build_ring_kernels()


@pytest.fixture
def ring():
    ring = TaskRing.create(f"test-dring-{uuid.uuid4().hex[:8]}", RingLayout(slots=2, max_tokens=4, hidden=24, top_k=3))
    yield ring
    ring.close()


def serve_once(slot, answer: str = "double") -> threading.Thread:
    """A worker thread: waits for SUBMITTED, checks the descriptor, writes 2 * x (or fails)."""
    def run():
        deadline = time.monotonic() + 30
        while int(slot["ctrl"][0]) != SUBMITTED:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        t, k = int(slot["ctrl"][2]), int(slot["ctrl"][3])
        slot["out"][: t * 24].copy_(slot["x"][: t * 24] * 2 + slot["rows"][: t * k].sum() + slot["weights"][0])
        slot["ctrl"][0] = DONE if answer == "double" else FAILED
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_post_and_collect_through_the_ring(kernels, ring) -> None:
    slot = ring.slots[0]
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    rows, weights = torch.tensor([[4, -1, 9], [1, 2, 3], [-1, -1, 7]]), torch.rand(3, 3)
    for round_ in range(2):  # the slot is free again after a collect, and the sequence number moves on
        worker = serve_once(slot)
        device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, rows, weights, kernels)
        out = device_ring.collect(slot["ctrl"], slot["out"], torch.empty(3, 24), 10**7, kernels)
        worker.join(30)
        assert torch.equal(out, x.float() * 2 + rows.sum() + weights.reshape(-1)[0])  # bf16 -> fp32 exact
        assert slot["ctrl"][:5].tolist() == [FREE, round_ + 1, 3, 3, 1]
        device_ring.raise_if_failed(slot["ctrl"])


def test_timeout_and_failure_reach_the_host(kernels, ring) -> None:
    slot = ring.slots[0]
    x, rows, weights = torch.randn(1, 24), torch.tensor([[1, 2, 3]]), torch.rand(1, 3)
    device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, rows, weights, kernels)
    out = device_ring.collect(slot["ctrl"], slot["out"], torch.full((1, 24), 5.0), 50, kernels)  # nobody serves
    assert torch.equal(out, torch.zeros(1, 24)) and int(slot["ctrl"][0]) == SUBMITTED
    with pytest.raises(TimeoutError):
        device_ring.raise_if_failed(slot["ctrl"])
    slot["ctrl"][0] = FREE
    worker = serve_once(slot, answer="fail")
    device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, rows, weights, kernels)
    out = device_ring.collect(slot["ctrl"], slot["out"], torch.full((1, 24), 5.0), 10**7, kernels)
    worker.join(30)
    assert torch.equal(out, torch.zeros(1, 24)) and int(slot["ctrl"][0]) == FREE
    with pytest.raises(RuntimeError, match="failed"):
        device_ring.raise_if_failed(slot["ctrl"])


def test_after_a_timeout_later_layers_neither_post_nor_wait(kernels, ring) -> None:
    """A timed-out task keeps its slot SUBMITTED: the next layer's post writes nothing (the worker
    may still read that payload), its collect returns zeros at once, and the error the host sees
    after the step is the worst one; once cleared, the slot works again."""
    slot = ring.slots[0]
    x, rows, weights = torch.randn(2, 24), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.rand(2, 3)
    device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x, rows, weights, kernels)
    device_ring.collect(slot["ctrl"], slot["out"], torch.empty(2, 24), 20, kernels)  # nobody answers
    stale = slot["x"].clone()
    device_ring.post(slot["ctrl"], slot["x"], slot["rows"], slot["weights"], x * 3, rows, weights, kernels)
    started = time.monotonic()
    out = device_ring.collect(slot["ctrl"], slot["out"], torch.full((2, 24), 7.0), 10**9, kernels)
    assert time.monotonic() - started < 10 and torch.equal(out, torch.zeros(2, 24))  # no spin
    assert torch.equal(slot["x"], stale) and int(slot["ctrl"][1]) == 1  # nothing posted over the stale task
    with pytest.raises(RuntimeError, match="still busy"):
        device_ring.raise_if_failed(slot["ctrl"])
    assert int(slot["ctrl"][device_ring.ERROR_WORD]) == 0
