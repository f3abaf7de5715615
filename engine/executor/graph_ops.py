"""The native CPU kernels and the expert hierarchy's data-dependent parts as torch custom ops
(``torch.ops.hearth.*``), so that ``torch.compile(fullgraph=True)`` sees each as one opaque node
instead of breaking the graph at a pybind call, a ``.tolist()`` or a fill count read.

Each op's body is what the eager engine runs (the same functions, the same numerics); each has a
fake (meta) implementation giving its output's shape, so the compiler can trace around it. Ops that
write into their arguments declare it (``mutates_args``). On a CUDA device these ops are where
count-aware kernels go; on the CPU they are the proof that the decode step has no host
synchronisation and no data-dependent Python between them (``engine/executor/fixed_shape.py``).

Importing this module registers the ops.
"""

from __future__ import annotations

import torch

from hearth.engine.experts.compute import routed_partial_sum
from hearth.engine.experts.mechanism.device import copy_experts
from hearth.engine.experts.mechanism.ring import await_task, write_task
from hearth.engine.experts.policy.cache import cache_step
from hearth.engine.experts.pool import ExpertBlocks
from hearth.engine.kernels.cpu import cpu_decode_ops
from hearth.engine.kernels.gpu import device_experts, device_fill, device_ring
from hearth.engine.kernels.ring_words import FREE
from hearth.engine.ops import activation, decode_blocks, linear
from hearth.engine.quant.registry import FORMATS, HEARTH_FORMATS


def _format(name: str):
    return FORMATS.get(name) or HEARTH_FORMATS[name]


@torch.library.custom_op("hearth::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`hearth.engine.ops.linear` of a float weight (the native decode kernel for a few rows)."""
    return linear(x, weight, bias)


@linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hearth::linear_blocks", mutates_args=())
def linear_blocks_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                     int8: bool) -> torch.Tensor:
    """:func:`hearth.engine.ops.linear` of a weight kept in its quantized blocks (format ``fmt``)."""
    param = weight.detach()  # a fresh tensor object to carry the block format the eager path reads
    param.block_format = _format(fmt)
    param.int8_activations = int8
    return linear(x, param, bias)


@linear_blocks_op.register_fake
def _(x, weight, bias, fmt, int8):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("hearth::decode_blocks", mutates_args=())
def decode_blocks_op(data: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """uint8 rows of blocks [rows, row bytes] -> float32 [rows, cols] (e.g. embedding rows)."""
    return decode_blocks(data, _format(fmt), cols)


@decode_blocks_op.register_fake
def _(data, fmt, cols):
    return data.new_empty((data.shape[0], cols), dtype=torch.float32)


@torch.library.custom_op("hearth::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The native RMSNorm (``layers/norm.py``): weight * round(x * rsqrt(mean(x^2) + eps))."""
    ops = cpu_decode_ops()
    if ops is not None and x.is_cpu and x.dtype == weight.dtype == torch.float32:  # (half types: torch's, as there)
        return ops.rms_norm(x, weight, eps)
    return weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("hearth::routed_experts", mutates_args=())
def routed_experts_op(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor,
                      weights: torch.Tensor, act: str, gate_up_fmt: str, down_fmt: str, inter: int,
                      int8: bool) -> torch.Tensor:
    """fp32 [T, H] partial sum of the routed pairs whose bank row is >= 0 (``rows`` [T, k], -1 =
    served elsewhere): :func:`~hearth.engine.experts.compute.routed_partial_sum`. ``gate_up_fmt``
    empty for float banks, else the layer's block formats. On a GPU, float banks go through two
    fixed-grid kernels (``kernels/gpu/device_experts.py``): no host read, so a captured graph replays it."""
    if x.is_cuda and gate_up.is_cuda and not gate_up_fmt and act in ("silu", "swish"):
        return device_experts.slot_experts(x, gate_up, down, rows, weights)
    blocks = None
    if gate_up_fmt:
        blocks = ExpertBlocks(_format(gate_up_fmt), _format(down_fmt), x.shape[1], inter, int8)
    return routed_partial_sum(x, gate_up, down, rows, weights, activation(act), blocks)


@routed_experts_op.register_fake
def _(x, gate_up, down, rows, weights, act, gate_up_fmt, down_fmt, inter, int8):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("hearth::cache_step",
                         mutates_args=("slot_of", "expert_of", "last_used", "clock", "stats"))
def cache_step_op(ids: torch.Tensor, slot_of: torch.Tensor, expert_of: torch.Tensor, last_used: torch.Tensor,
                  clock: torch.Tensor, qtable: torch.Tensor, stats: torch.Tensor,
                  num_candidates: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert cache's control step on its tables, in place (``policy/cache.py``): the native
    one on host tables, the tensor one elsewhere; (pair_slot, src, dst, count)."""
    ops = cpu_decode_ops() if ids.is_cpu else None
    fn = ops.cache_step_host if ops is not None else cache_step
    pair_slot, src, dst, count = fn(ids, slot_of, expert_of, last_used, clock, qtable, stats, num_candidates)
    return pair_slot.clone(), src.clone(), dst.clone(), count.reshape(()).clone()  # outputs never alias inputs


@cache_step_op.register_fake
def _(ids, slot_of, expert_of, last_used, clock, qtable, stats, num_candidates):
    return (torch.empty_like(ids), ids.new_empty((num_candidates,)), ids.new_empty((num_candidates,)),
            ids.new_empty(()))


@torch.library.custom_op("hearth::fill_slots", mutates_args=("slots_gate_up", "slots_down"))
def fill_slots_op(slots_gate_up: torch.Tensor, slots_down: torch.Tensor, pool_gate_up: torch.Tensor,
                  pool_down: torch.Tensor, row_table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                  count: torch.Tensor) -> None:
    """Copy the first ``count`` planned fills (global ids ``src`` -> slots ``dst``) from the pool into
    the slot arena. The count is read here, where the copy runs, not by the graph around it: the
    count-aware gather a captured step needs. On a GPU with the pool mapped (device views of its
    pages), a kernel reads the count on the device and no host read happens at all."""
    if slots_gate_up.is_cuda and pool_gate_up.is_cuda:
        for slots, pool in ((slots_gate_up, pool_gate_up), (slots_down, pool_down)):
            device_fill.fill_rows(slots, pool, row_table, src, dst, count)
        return
    n = int(count)
    if n:
        copy_experts((slots_gate_up, slots_down), dst[:n].cpu(), (pool_gate_up, pool_down),
                     row_table[src[:n].to(row_table.device)])


@fill_slots_op.register_fake
def _(slots_gate_up, slots_down, pool_gate_up, pool_down, row_table, src, dst, count):
    return None


# The ring ops write shared memory that another process reads while the step runs: that is I/O, not
# a mutation the compiler may defer or apply to a copy (functionalization would). So they declare no
# mutation; the post returns a ticket that the collect takes, which keeps both in the graph and in
# order.
@torch.library.custom_op("hearth::ring_post", mutates_args=())
def ring_post_op(ctrl: torch.Tensor, x_slot: torch.Tensor, rows_slot: torch.Tensor, weights_slot: torch.Tensor,
                 x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Hand a CPU share to the CPU expert workers through a descriptor of the shared task ring
    (``mechanism/ring.py``): the payload into the slot's buffers, then its state word SUBMITTED,
    last. The worker computes while the step goes on with the device share; :func:`ring_collect_op`
    waits for the completion flag. Returns the ticket: the descriptor's sequence number, or 0 when
    no row is >= 0 (nothing for the CPU: nothing is posted, the slot stays free and the collect
    returns zeros without waiting)."""
    if ctrl.is_cuda:  # the ring's device views: the GPU writes the descriptor (kernels/gpu/device_ring.py)
        return device_ring.post(ctrl, x_slot, rows_slot, weights_slot, x, rows, weights)
    if not bool((rows >= 0).any()):  # the same choice the device kernel makes
        return torch.tensor(0)
    if int(ctrl[0]) != FREE:
        raise RuntimeError("the CPU expert ring's slot is still busy")
    seq = int(ctrl[1]) + 1
    write_task({"ctrl": ctrl, "x": x_slot, "rows": rows_slot, "weights": weights_slot}, x, rows, weights, seq)
    return torch.tensor(seq)


@ring_post_op.register_fake
def _(ctrl, x_slot, rows_slot, weights_slot, x, rows, weights):
    return ctrl.new_empty(())


@torch.library.custom_op("hearth::ring_collect", mutates_args=())  # shared memory: see ring_post
def ring_collect_op(ticket: torch.Tensor, ctrl: torch.Tensor, out_slot: torch.Tensor, tokens: int, hidden: int,
                    timeout_s: float) -> torch.Tensor:
    """Wait for the ring slot's completion flag and return its fp32 [tokens, hidden] result; the
    slot is free again afterwards. A worker that fails or stays silent past ``timeout_s`` raises.
    A ticket of 0 (nothing was posted) gives zeros at once (on the GPU the kernel sees the slot
    still FREE)."""
    if ctrl.is_cuda:  # the GPU waits for the completion word itself; errors reach the host after the step
        out = out_slot.new_empty((tokens, hidden))
        return device_ring.collect(ctrl, out_slot, out, int(timeout_s * 1e6))
    if int(ticket) == 0:
        return out_slot.new_zeros((tokens, hidden))
    return await_task({"ctrl": ctrl, "out": out_slot}, tokens, hidden, timeout_s)[0]


@ring_collect_op.register_fake
def _(ticket, ctrl, out_slot, tokens, hidden, timeout_s):
    return out_slot.new_empty((tokens, hidden))
