"""Checkpoint formats and loading: Hugging Face safetensors directories (:mod:`.loader`, quantized
ones through :mod:`.hf_quant`), GGUF files (:mod:`.gguf_file`, :mod:`.gguf_loader`,
:mod:`.gguf_writer`), hearth's FTW directories (:mod:`.ftw`), what a checkpoint holds
(:mod:`.inspect`) and the bundled demo model (:mod:`.demo`).

The names below are the package's public face for serving and cluster: a checkpoint's config and
sizes, and FTW conversion and loading (a cluster's shared expert pool is read from FTW files)."""

from hearth.engine.checkpoint.ftw import convert, is_ftw, load_checkpoint
from hearth.engine.checkpoint.inspect import summarize
from hearth.engine.checkpoint.loader import load_config

__all__ = ["convert", "is_ftw", "load_checkpoint", "load_config", "summarize"]
