"""The count-aware fill a captured decode step needs: copy the first ``count`` planned experts from the
host pool into their cache slots, with ``count`` read by the kernel from device memory, so the host
never waits for it and the launch has the same shape at every step (a CUDA graph replays it).

The pool is read in place across PCIe: after ``cudaHostRegister`` (pinned, mapped) its pages have a
device address, and :func:`mapped_view` wraps that address as a CUDA tensor without copying. The
kernel is a Triton kernel (Triton ships with PyTorch's CUDA builds). Its grid is a fixed, small number
of programs (set by the shapes alone, so a CUDA graph replays the same launch): the work, ``count``
rows of chunks of BLOCK words, is dealt out to them in turn, so that a step filling one expert keeps
every program busy and a step filling none costs a few hundred programs that end at once (a grid of (max
fills, chunks) launched ~150k programs per layer at Qwen3-30B-A3B's shapes, nearly all idle). On a machine
without a GPU the same kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
checks it.
"""

from __future__ import annotations

import ctypes
import functools

import torch

BLOCK = 1024  # words of a row one program copies at a time
# Programs of a fill launch: about two per SM of a 132-SM GPU, enough reads in flight to keep a PCIe
# link busy; the work beyond them is looped over.
PROGRAMS = 256


def build_fill_kernel():
    """The jitted kernel (built on first use, so that the interpreter setting in force then applies)."""
    import triton  # deferred: triton is optional
    import triton.language as tl  # deferred: triton is optional

    @triton.jit
    def fill_rows_kernel(src_bank, dst_bank, row_table, src_ids, dst_slots, count, num_fills, row_words, chunks,
                         BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr convention
        # The plan's count, read here on the device (never past the planned entries); chunk i of the
        # work is chunk i % chunks of fill i // chunks, and program p copies chunks p, p + programs, ...
        work = tl.minimum(tl.load(count), num_fills) * chunks
        for i in range(tl.program_id(0), work, tl.num_programs(0)):
            j = i // chunks
            row = tl.load(row_table + tl.load(src_ids + j))
            slot = tl.load(dst_slots + j)
            offs = (i % chunks) * BLOCK + tl.arange(0, BLOCK)
            inside = offs < row_words
            words = tl.load(src_bank + row * row_words + offs, mask=inside)
            tl.store(dst_bank + slot * row_words + offs, words, mask=inside)

    return fill_rows_kernel


@functools.cache
def fill_kernel():
    return build_fill_kernel()


def available() -> bool:
    """Whether the kernel can run here (Triton importable)."""
    try:
        import triton  # noqa: F401 - deferred: triton is optional
    except ImportError:
        return False
    return True


def word_view(bank: torch.Tensor) -> torch.Tensor:
    """A contiguous bank [rows, ...] as [rows, words] of the widest integer type that divides a row."""
    rows = bank.shape[0]
    raw = bank.reshape(rows, -1).view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if raw.shape[1] % size == 0:
            return raw.view(dtype)
    return raw


def fill_rows(dst_bank: torch.Tensor, src_bank: torch.Tensor, row_table: torch.Tensor, src_ids: torch.Tensor,
              dst_slots: torch.Tensor, count: torch.Tensor, kernel=None, programs: int = PROGRAMS) -> None:
    """``dst_bank[dst_slots[j]] = src_bank[row_table[src_ids[j]]]`` for j < ``count`` (a one-element
    tensor the kernel reads; at most ``src_ids.numel()``); entries past it are never read. All tensors
    on the kernel's device (the pool as a :func:`mapped_view`). At most ``programs`` programs run."""
    dst, src = word_view(dst_bank), word_view(src_bank)
    if dst.shape[1] != src.shape[1] or dst.dtype != src.dtype:
        raise ValueError("fill_rows: slot and pool rows of different sizes")
    if src_ids.numel() == 0:
        return
    row_words = dst.shape[1]
    chunks = -(-row_words // BLOCK)
    grid = (fill_grid(src_ids.numel(), chunks, programs),)
    (kernel or fill_kernel())[grid](src, dst, row_table, src_ids, dst_slots, count.reshape(1), src_ids.numel(),
                                    row_words, chunks, BLOCK=BLOCK)


def fill_grid(num_fills: int, chunks: int, programs: int = PROGRAMS) -> int:
    """Programs of a fill launch for up to ``num_fills`` rows of ``chunks`` chunks: no more than the
    most work there can be, nor than ``programs``; fixed by the shapes, never by the count."""
    return max(1, min(num_fills * chunks, programs))


class _DevicePointer:
    """A device address as a ``__cuda_array_interface__`` (what ``torch.as_tensor`` adopts without copying)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None}
        self.owner = owner  # keeps the host tensor alive as long as the view


def mapped_view(host: torch.Tensor, device: torch.device | str = "cuda") -> torch.Tensor:
    """A CUDA tensor over ``host``'s registered (pinned, mapped) pages, read across PCIe in place.
    ``host`` must be contiguous and lie inside a range registered with ``cudaHostRegister`` and the
    mapped flag; it need not start the range (``pin_host_memory`` registers whole pages around the
    tensors, merged), as the runtime maps any address inside a registered range."""
    if not host.is_contiguous():
        raise ValueError("mapped_view: a contiguous host tensor")
    cudart = _cudart()
    ptr = ctypes.c_void_p()
    err = cudart.cudaHostGetDevicePointer(ctypes.byref(ptr), ctypes.c_void_p(host.data_ptr()), 0)
    if err != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer failed ({err}): is the pool registered as mapped?")
    flat = host.view(torch.uint8).reshape(-1)
    view = torch.as_tensor(_DevicePointer(ptr.value, (flat.numel(),), "|u1", host), device=device)
    return view.view(host.dtype).view(host.shape)


def cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime library PyTorch loaded (calls torch's binding does not expose)."""
    return _cudart()


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime PyTorch loaded (its process already holds it; no second copy is opened)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    raise RuntimeError("the CUDA runtime library (libcudart) is not loadable")
