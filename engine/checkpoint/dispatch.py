"""The one place a checkpoint's format is told apart: a GGUF file, an FTW directory, or a Hugging
Face directory (plain, or quantized as shipped). Its config (:func:`load_config`), its weights
(:func:`load_checkpoint`) and its conversion to FTW (:func:`convert`) each go to that format's
module from here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from hearth.engine.checkpoint.common import LoadedModel, PoolFactory
from hearth.engine.checkpoint.ftw import DEFAULT_SHARD_BYTES, is_ftw, load_ftw, read_index
from hearth.engine.checkpoint.ftw_writer import write_ftw
from hearth.engine.checkpoint.gguf_reader import is_gguf, load_gguf, load_gguf_config
from hearth.engine.checkpoint.hf import load_hf_config, load_model
from hearth.engine.config import ConfigError

Format = Literal["gguf", "ftw", "hf"]


def checkpoint_format(path: str | Path) -> Format:
    """Which format ``path`` holds: ``gguf`` (a ``.gguf`` file), ``ftw`` (a directory with an FTW
    index), else ``hf`` (a Hugging Face directory; whether it is one is checked when it is read)."""
    if is_gguf(path):
        return "gguf"
    return "ftw" if is_ftw(path) else "hf"


def load_config(path: str | Path, dtype: str | torch.dtype | None = None):
    """Parse a checkpoint's config into (family, ModelConfig): a GGUF file's from its metadata, a
    directory's from its config.json (an FTW directory computes in the dtype it stores, unless
    ``dtype`` says otherwise)."""
    kind = checkpoint_format(path)
    if kind == "gguf":
        return load_gguf_config(path, dtype)
    if kind == "ftw" and dtype in (None, "auto"):
        dtype = read_index(path)["dtype"]
    return load_hf_config(path, dtype)


def load_checkpoint(path: str | Path, dtype: str | torch.dtype | None = None, pool_factory: PoolFactory | None = None,
                    verify: bool = True, show_progress: bool = False,
                    filled_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
                    keep_blocks: bool = True, layers: tuple[int, int] | None = None) -> LoadedModel:
    """Load an FTW directory, a GGUF file, or a Hugging Face directory (converted in memory to the
    same layout). ``keep_blocks``: quantized weights (a GGUF file's, an FP8 / MXFP4 checkpoint's, or
    an FTW directory's stored in blocks) may stay in their blocks (not when CPU worker processes,
    which compute float experts, share the pool)."""
    kind = checkpoint_format(path)
    if kind == "gguf":
        if filled_pool is not None:
            raise ConfigError("re-attaching to a filled shared expert pool needs an FTW checkpoint")
        return load_gguf(path, dtype, show_progress=show_progress, pool_factory=pool_factory, keep_blocks=keep_blocks,
                         layers=layers)
    if kind == "ftw":
        return load_ftw(path, dtype, pool_factory, verify, show_progress, filled_pool=filled_pool,
                        keep_blocks=keep_blocks, layers=layers)
    if filled_pool is not None:
        raise ConfigError("re-attaching to a filled shared expert pool needs an FTW checkpoint "
                          "(convert it with `hearth convert`)")
    return load_model(path, dtype, show_progress=show_progress, pool_factory=pool_factory, keep_blocks=keep_blocks,
                      layers=layers)


def convert(src: str | Path, dst: str | Path, dtype: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
            show_progress: bool = False) -> Path:
    """Convert a Hugging Face checkpoint directory or a GGUF file into an FTW directory; returns its
    index path. Quantized weights (a GGUF file's, an FP8 or MXFP4 checkpoint's) are stored in their
    blocks, as they run in float32 (the default for them); with another ``dtype`` they are decoded
    to it."""
    if Path(dst).resolve() == Path(src).resolve():
        raise ConfigError("the FTW output directory must differ from the source checkpoint")
    if checkpoint_format(src) == "gguf":
        loaded = load_gguf(src, dtype, show_progress=show_progress, for_storage=True)
    else:
        loaded = load_model(src, dtype, show_progress=show_progress, for_storage=True)
    return write_ftw(loaded, dst, shard_bytes, show_progress)
