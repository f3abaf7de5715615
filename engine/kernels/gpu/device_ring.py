"""The CPU share of a captured decode step, handed over by the GPU itself: kernels that write a task
descriptor into the shared task ring (``experts/mechanism/ring.py``; its control words are
``kernels/ring_words.py``) and wait for its completion word, so the step needs no host
synchronisation and a CUDA graph can replay it.

The ring lives in host memory the CPU expert worker maps; registered with CUDA (pinned, mapped),
:func:`~hearth.engine.kernels.gpu.device_fill.mapped_view` gives it device addresses. ``post`` copies
the payload (activations as fp32, pool rows, weights) into a slot, then sets the slot's fields and
its state word SUBMITTED with a system-scope release, all from one program with barriers between,
so every payload write is ordered before the worker can see the state. A share with no pair for the
CPU (every row -1, e.g. every expert a cache hit) is not posted at all: the slot stays FREE, the
ticket says 0, and the collect, finding the slot FREE, returns zeros at once, so a layer with
nothing for the CPU costs two tiny launches, not a round trip to the worker (a captured graph keeps
both launches). ``collect`` spins on the state word with
system-scope acquires until the worker writes DONE (or FAILED, or ``limit`` spins pass), copies the
partial sum out and frees the slot; a failure or timeout is left in the slot's error word
(``ERROR_WORD``) for the host to raise after the step, and the partial sum is then zeros. On a
machine without a GPU the same kernels run under Triton's interpreter, which is how CI checks them
against a worker thread.
"""

from __future__ import annotations

import functools

import torch

from hearth.engine.kernels.ring_words import DONE, ERROR_WORD, FAILED, FREE, SUBMITTED

# ctrl[ERROR_WORD]: 0, or the worst of these since the host last cleared it.
TIMED_OUT, WORKER_FAILED, BUSY = 1, 2, 3
BLOCK = 1024


def build_ring_kernels():
    """(post, collect) jitted now, so that the interpreter setting in force applies."""
    return _build_post_kernel(), _build_collect_kernel()


def _build_post_kernel():
    import triton.language as tl  # deferred: triton is optional

    @triton_jit
    def post_kernel(ctrl, ticket, x_slot, rows_slot, weights_slot, x, rows, weights, n_x, n_pairs, tokens, top_k,
                    fp32_weights, FREE: tl.constexpr, SUBMITTED: tl.constexpr, BUSY: tl.constexpr,  # noqa: N803
                    BLOCK: tl.constexpr):
        """One program: the payload, a barrier, the fields, then SUBMITTED with a system-scope
        release, so the worker sees every payload write before the state; the ticket gets the
        task's sequence number. No row >= 0 (nothing for the CPU): nothing is written, the slot
        stays FREE and the ticket 0. A slot still busy (a task that timed out) or an error of an
        earlier layer: nothing is written either, the error stays (BUSY at least)."""
        # Any pair for the CPU? Each lane holding a row >= 0 raises the ticket (0 from the host) to 1,
        # atomically (no reduction: its library functions do not run under the interpreter the tests
        # switch on late); the barrier puts every lane's atomic before the read.
        for start in range(0, n_pairs, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            row = tl.load(rows + offs, mask=offs < n_pairs, other=-1)
            tl.atomic_max(ticket + offs * 0, (row >= 0).to(tl.int64), mask=row >= 0, sem="relaxed")
        tl.debug_barrier()
        found = tl.atomic_add(ticket, 0, sem="relaxed")  # 1: something to post; 0: nothing, the slot stays FREE
        state = tl.atomic_add(ctrl, 0, sem="acquire", scope="sys")
        if found != 0:
            if (state == FREE) & (tl.load(ctrl + 7) == 0):
                for start in range(0, n_x, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    tl.store(x_slot + offs, tl.load(x + offs, mask=offs < n_x).to(tl.float32), mask=offs < n_x)
                for start in range(0, n_pairs, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    inside = offs < n_pairs
                    tl.store(rows_slot + offs, tl.load(rows + offs, mask=inside), mask=inside)
                    tl.store(weights_slot + offs, tl.load(weights + offs, mask=inside).to(tl.float32), mask=inside)
                tl.debug_barrier()
                seq = tl.load(ctrl + 1) + 1
                tl.store(ctrl + 1, seq)
                tl.store(ctrl + 2, tokens)
                tl.store(ctrl + 3, top_k)
                tl.store(ctrl + 4, fp32_weights)
                tl.debug_barrier()
                tl.atomic_xchg(ctrl, SUBMITTED, sem="release", scope="sys")
                tl.store(ticket, seq)
            else:
                tl.store(ticket, 0)
                tl.atomic_max(ctrl + 7, BUSY, sem="relaxed", scope="sys")

    return post_kernel


def _build_collect_kernel():
    import triton.language as tl  # deferred: triton is optional

    @triton_jit
    def collect_kernel(ctrl, out_slot, out, n, limit, SUBMITTED: tl.constexpr, DONE: tl.constexpr,  # noqa: N803
                       FAILED: tl.constexpr, FREE: tl.constexpr, TIMED_OUT: tl.constexpr,
                       WORKER_FAILED: tl.constexpr, BLOCK: tl.constexpr):
        """Spin (``limit`` polls, each about one PCIe round trip) for the completion word; copy the
        result, or zeros when the task failed, timed out or was never posted (an error already
        set, or a FREE slot: the post had nothing for the CPU, and only a collect frees a slot, so
        a posted task is SUBMITTED, DONE or FAILED here); the error word only grows (the host reads
        and clears it after the step)."""
        state = tl.atomic_add(ctrl, 0, sem="acquire", scope="sys")
        posted = (tl.load(ctrl + 7) == 0) & (state != FREE)
        spins = 0
        while posted & (state == SUBMITTED) & (spins < limit):
            state = tl.atomic_add(ctrl, 0, sem="acquire", scope="sys")
            spins += 1
        ok = posted & (state == DONE)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < n
            tl.store(out + offs, tl.where(ok, tl.load(out_slot + offs, mask=inside), 0.0), mask=inside)
        if posted:
            error = tl.where(ok, 0, tl.where(state == FAILED, WORKER_FAILED, TIMED_OUT))
            tl.atomic_max(ctrl + 7, error, sem="relaxed", scope="sys")
            tl.debug_barrier()
            tl.atomic_xchg(ctrl, tl.where(state == SUBMITTED, state, FREE), sem="release", scope="sys")

    return collect_kernel


def triton_jit(fn):
    import triton  # deferred: triton is optional

    return triton.jit(fn)


@functools.cache
def ring_kernels():
    return build_ring_kernels()


def post(ctrl: torch.Tensor, x_slot: torch.Tensor, rows_slot: torch.Tensor, weights_slot: torch.Tensor,
         x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, kernels=None) -> torch.Tensor:
    """Write a task (x [T, H], rows and weights [T, k]) into a ring slot and publish it, from one
    program on the device; returns the ticket (int64 [], on ``ctrl``'s device): the task's sequence
    number, or 0 when nothing was posted (no row >= 0, or the slot busy). The slot's tensors are
    device views of the ring (on a machine without a GPU, the ring itself)."""
    kernel, _ = kernels or ring_kernels()
    t, k = rows.shape
    ticket = ctrl.new_zeros(())
    kernel[(1,)](ctrl, ticket, x_slot, rows_slot, weights_slot, x.contiguous().reshape(-1),
                 rows.contiguous().reshape(-1), weights.contiguous().reshape(-1), x.numel(), rows.numel(), t, k,
                 int(weights.dtype == torch.float32), FREE=FREE, SUBMITTED=SUBMITTED, BUSY=BUSY, BLOCK=BLOCK)
    return ticket


def collect(ctrl: torch.Tensor, out_slot: torch.Tensor, out: torch.Tensor, limit: int, kernels=None) -> torch.Tensor:
    """Wait (on the device) for the slot's completion word and copy its fp32 partial sum into
    ``out`` [T, H]; the slot is free again. A share the post found empty (the slot still FREE) gives
    zeros at once, with no error. A failure, ``limit`` polls without an answer, or a task that was
    never posted for a busy slot leave zeros in ``out`` and a code in ``ctrl[ERROR_WORD]`` (see
    :func:`raise_if_failed`)."""
    _, wait = kernels or ring_kernels()
    wait[(1,)](ctrl, out_slot, out, out.numel(), limit, SUBMITTED=SUBMITTED, DONE=DONE, FAILED=FAILED, FREE=FREE,
               TIMED_OUT=TIMED_OUT, WORKER_FAILED=WORKER_FAILED, BLOCK=BLOCK)
    return out


def raise_if_failed(ctrl: torch.Tensor) -> None:
    """After a step has finished (the host side of the ring): raise what its collects left behind,
    clearing the error word for the next step."""
    code = int(ctrl[ERROR_WORD])
    if code:
        ctrl[ERROR_WORD] = 0
    if code == BUSY:
        raise RuntimeError("a GPU step found the CPU expert ring's slot still busy (an earlier task timed out)")
    if code == TIMED_OUT:
        raise TimeoutError("the CPU expert worker did not answer a GPU step's task in time")
    if code == WORKER_FAILED:
        raise RuntimeError("the CPU expert worker failed on a GPU step's task (see its log)")
