"""The CPU share of a captured decode step, handed over by the GPU itself: kernels that write a task
descriptor into the shared task ring (``experts/mechanism/ring.py``) and wait for its completion
word, so the step needs no host synchronisation and a CUDA graph can replay it.

The ring lives in host memory the CPU expert worker maps; registered with CUDA (pinned, mapped),
:func:`~hearth.engine.kernels.device_fill.mapped_view` gives it device addresses. ``post`` copies
the payload (activations as fp32, pool rows, weights) into a slot, then sets the slot's fields and
its state word SUBMITTED with a system-scope release, in a second launch, so every payload write of
the first is complete before the worker can see the state. ``collect`` spins on the state word with
system-scope acquires until the worker writes DONE (or FAILED, or ``limit`` spins pass), copies the
partial sum out and frees the slot; a failure or timeout is left in the slot's error word
(``ERROR_WORD``) for the host to raise after the step, and the partial sum is then zeros. On a
machine without a GPU the same kernels run under Triton's interpreter, which is how CI checks them
against a worker thread.
"""

from __future__ import annotations

import functools

import torch

from hearth.engine.experts.mechanism.ring import DONE, FAILED, FREE, SUBMITTED

ERROR_WORD = 7  # ctrl[7]: 0, or TIMED_OUT / WORKER_FAILED after a collect
TIMED_OUT, WORKER_FAILED = 1, 2
BLOCK = 1024


def build_ring_kernels():
    """(copy, publish, collect) jitted now, so that the interpreter setting in force applies."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(dst, src, n, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr convention
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=inside).to(dst.dtype.element_ty), mask=inside)

    @triton.jit
    def publish_kernel(ctrl, tokens, top_k, fp32_weights, SUBMITTED: tl.constexpr):  # noqa: N803
        seq = tl.load(ctrl + 1) + 1
        tl.store(ctrl + 1, seq)
        tl.store(ctrl + 2, tokens)
        tl.store(ctrl + 3, top_k)
        tl.store(ctrl + 4, fp32_weights)
        tl.store(ctrl + 7, 0)
        tl.atomic_xchg(ctrl, SUBMITTED, sem="release", scope="sys")  # last: after every payload write

    @triton.jit
    def collect_kernel(ctrl, out_slot, out, n, limit, SUBMITTED: tl.constexpr, DONE: tl.constexpr,  # noqa: N803
                       FAILED: tl.constexpr, FREE: tl.constexpr, TIMED_OUT: tl.constexpr,
                       WORKER_FAILED: tl.constexpr, BLOCK: tl.constexpr):
        state = tl.atomic_add(ctrl, 0, sem="acquire", scope="sys")
        spins = 0
        while (state == SUBMITTED) & (spins < limit):
            state = tl.atomic_add(ctrl, 0, sem="acquire", scope="sys")
            spins += 1
        ok = state == DONE
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < n
            tl.store(out + offs, tl.where(ok, tl.load(out_slot + offs, mask=inside), 0.0), mask=inside)
        error = tl.where(ok, 0, tl.where(state == FAILED, WORKER_FAILED, TIMED_OUT))
        tl.store(ctrl + 7, error)
        tl.atomic_xchg(ctrl, tl.where(state == SUBMITTED, state, FREE), sem="release", scope="sys")

    return copy_kernel, publish_kernel, collect_kernel


@functools.cache
def ring_kernels():
    return build_ring_kernels()


def post(ctrl: torch.Tensor, x_slot: torch.Tensor, rows_slot: torch.Tensor, weights_slot: torch.Tensor,
         x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, kernels=None) -> None:
    """Write a task (x [T, H], rows and weights [T, k]) into a ring slot and publish it. The slot's
    tensors are device views of the ring (on a machine without a GPU, the ring itself)."""
    import triton

    copy, publish, _ = kernels or ring_kernels()
    for dst, src in ((x_slot, x), (rows_slot, rows), (weights_slot, weights)):
        n = src.numel()
        copy[(triton.cdiv(n, BLOCK),)](dst, src.reshape(-1), n, BLOCK=BLOCK)
    t, k = rows.shape
    publish[(1,)](ctrl, t, k, int(weights.dtype == torch.float32), SUBMITTED=SUBMITTED)


def collect(ctrl: torch.Tensor, out_slot: torch.Tensor, out: torch.Tensor, limit: int, kernels=None) -> torch.Tensor:
    """Wait (on the device) for the slot's completion word and copy its fp32 partial sum into
    ``out`` [T, H]; the slot is free again. A failure or ``limit`` spins leave zeros in ``out`` and
    a code in ``ctrl[ERROR_WORD]`` (see :func:`raise_if_failed`)."""
    _, _, wait = kernels or ring_kernels()
    wait[(1,)](ctrl, out_slot, out, out.numel(), limit, SUBMITTED=SUBMITTED, DONE=DONE, FAILED=FAILED, FREE=FREE,
               TIMED_OUT=TIMED_OUT, WORKER_FAILED=WORKER_FAILED, BLOCK=BLOCK)
    return out


def raise_if_failed(ctrl: torch.Tensor) -> None:
    """After a step (the host side of the ring, no GPU read): raise what a collect left behind."""
    code = int(ctrl[ERROR_WORD])
    if code == TIMED_OUT:
        raise TimeoutError("the CPU expert worker did not answer a GPU step's task in time")
    if code == WORKER_FAILED:
        raise RuntimeError("the CPU expert worker failed on a GPU step's task (see its log)")
