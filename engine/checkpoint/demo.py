"""The model ``hearth serve``, ``hearth generate`` and ``hearth up`` use when none is given.

``hearth-demo`` is a small trained Qwen3-MoE (6 layers, 32 experts, top-4; about 33 MB in bf16)
that ships inside the package, so a fresh install serves it with no network. It was trained by
``tools/train_demo.py`` on the Python standard library's sources and writes Python-looking code;
its routing has real locality, which makes it the source of the benchmark traces.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEMO_NAME = "hearth-demo"


def demo_model_dir() -> Path:
    """The bundled demo checkpoint (inside the installed ``hearth.engine`` package)."""
    path = Path(str(files("hearth.engine") / "assets" / DEMO_NAME))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: the bundled demo model is missing (a partial checkout or install?); "
                                f"rebuild it with `python tools/train_demo.py --out {path}` or pass --model")
    return path

