"""Where the dense part of a model runs: the executor's device (the GPU executor where CUDA is present).

Every non-expert tensor (embeddings, attention, norms, routers, shared experts, the head) moves to
the device; the experts stay in the host pool, which is the source of truth, and reach the device
only through the expert cache's slots. Moving keeps what aliases what: the fused q/k/v matrix and
its three projection views, tied embeddings, stay one storage on the device, and the attributes a
loader put on a parameter (a quantized weight's block format) stay on it.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """The executor device for a ``device`` setting: ``auto`` is CUDA where it is present."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available on this machine")
    return device


def move_module(module: nn.Module, device: torch.device | str) -> None:
    """Move ``module``'s parameters and buffers to ``device`` in place. Tensors sharing a storage
    share one storage on the device (views keep their offsets and strides); a tensor reached twice
    (tied weights) is moved once; a parameter's Python attributes are kept."""
    device = torch.device(device)
    storages: dict[tuple[int, int], torch.UntypedStorage] = {}
    done: dict[int, torch.Tensor] = {}

    def moved(t: torch.Tensor) -> torch.Tensor:
        if id(t) in done:
            return done[id(t)]
        if t.device == device:
            done[id(t)] = t
            return t
        source = t.untyped_storage()
        key = (source.data_ptr(), source.nbytes())
        if key not in storages:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(source)  # the whole storage
            storages[key] = flat.to(device).untyped_storage()
        view = torch.empty(0, dtype=t.dtype, device=device).set_(storages[key], t.storage_offset(), t.shape,
                                                                  t.stride())
        out = nn.Parameter(view, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else view
        out.__dict__.update(t.__dict__)  # e.g. block_format, int8_activations
        done[id(t)] = out
        return out

    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = moved(p)
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = moved(b)
