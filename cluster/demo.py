"""The model ``hearth serve`` uses when none is given.

Until a trained demo model ships with the package, this is a deterministic *tiny random* MoE
(Qwen3-MoE layout, agent chat template with tools and thinking) written on first use into the
user cache. It exercises every path of the server, but its text is noise; its name says so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "hearth-demo-tiny-random"
_DEMO_SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, head_dim=32)
_DEMO_VERSION = "1"  # bump when the recipe changes so old caches are rebuilt


def cache_dir() -> Path:
    """hearth's user cache: ``$HEARTH_CACHE``, else ``$XDG_CACHE_HOME/hearth``, else ``~/.cache/hearth``."""
    if os.environ.get("HEARTH_CACHE"):
        return Path(os.environ["HEARTH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hearth"


def demo_model_dir(show_progress: bool = True) -> Path:
    """The demo checkpoint's directory, generated (a few seconds, no download) if missing."""
    target = cache_dir() / "models" / f"{DEMO_NAME}-v{_DEMO_VERSION}"
    if (target / "config.json").is_file():
        return target
    from engine.testing import make_checkpoint

    if show_progress:
        print(f"hearth: generating the demo model (tiny, random weights) in {target}", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        make_checkpoint(tmp, "qwen3_moe", dtype="bfloat16", seed=0, chat_format="agent", **_DEMO_SHAPE)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
