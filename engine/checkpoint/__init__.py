"""Checkpoint formats and loading.

- :mod:`.dispatch` tells the formats apart: a checkpoint's config (``load_config``), its weights
  (``load_checkpoint``) and its conversion to FTW (``convert``), whatever its format;
- :mod:`.common` holds what every reader shares: ``CheckpointError``, ``LoadedModel``, a pipeline
  stage's share of the tensors, the expert tensor names, weights kept in their blocks;
- :mod:`.hf` reads Hugging Face safetensors directories, :mod:`.hf_quant` their FP8 / MXFP4 tensors;
- :mod:`.gguf_reader` reads GGUF files, :mod:`.gguf_writer` writes them (``hearth convert --quant``);
- :mod:`.ftw` is hearth's own FTW format and its reader, :mod:`.ftw_writer` its writer;
- :mod:`.inspect` says what a model and a checkpoint hold; :mod:`.demo` finds the bundled demo model.

Imports among these modules run one way, with :mod:`.common` at the bottom and :mod:`.dispatch`
and :mod:`.inspect` at the top: a format's module never imports the dispatch, and no module imports
another inside a function to hide a cycle.
"""

from hearth.engine.checkpoint.dispatch import convert, load_checkpoint, load_config
from hearth.engine.checkpoint.ftw import is_ftw
from hearth.engine.checkpoint.inspect import summarize

__all__ = ["convert", "is_ftw", "load_checkpoint", "load_config", "summarize"]
