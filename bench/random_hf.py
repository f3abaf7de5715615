"""Random Hugging Face checkpoints at sizes no CPU cache holds, written layer by layer.

``tests.checkpoints.make_checkpoint`` builds the whole transformers model in fp32 first, so a ~5B
model would need ~21 GB before it is cast; here transformers builds and saves the model with one
layer, and the other layers are written from that layer's tensor names and shapes with fresh random
values, one shard at a time (peak memory: one layer plus the embeddings). The result is what
``save_pretrained`` writes (per-expert tensor names, an index, the config), so llama.cpp's converter,
transformers and hearth all read it.

    python bench/random_hf.py /tmp/qwen3-5b --shape 5b [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import RANDOM_1B  # noqa: E402

# The ~5B Qwen3-MoE that issue-42-style comparisons use: 5.2B parameters, 0.93B active a token.
SHAPES = {
    "1b": RANDOM_1B["qwen3_moe"],
    "5b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
               num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, intermediate_size=4096,
               norm_topk_prob=True, initializer_range=0.02),
}
LAYER = re.compile(r"\.layers\.0\.")


def write_random_hf(out: Path, shape: dict, dtype: str = "bfloat16", vocab_size: int = 32000, seed: int = 0) -> Path:
    """Write a random ``qwen3_moe`` checkpoint of ``shape`` (transformers config fields) to ``out``."""
    from tests.checkpoints import make_checkpoint

    layers = shape["num_hidden_layers"]
    with tempfile.TemporaryDirectory() as scratch:
        one = Path(scratch)
        make_checkpoint(one, "qwen3_moe", "per_expert", dtype, seed=seed, shard_bytes=1 << 40,
                        vocab_size=vocab_size, **{**shape, "num_hidden_layers": 1})
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(one.glob("*.safetensors")):
            tensors.update(load_file(shard))
        out.mkdir(parents=True, exist_ok=True)
        for extra in one.iterdir():  # tokenizer, generation config, chat template
            if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json":
                (out / extra.name).write_bytes(extra.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists grow with the layers (or stay empty)
        if isinstance(config.get(key), list) and len(config[key]) == 1:
            config[key] = config[key] * layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_layers(out, tensors, layers, torch.Generator().manual_seed(seed + 1), shape["initializer_range"])
    return out


def _write_layers(out: Path, tensors: dict[str, torch.Tensor], layers: int, gen: torch.Generator,
                  std: float) -> None:
    """One shard for the tensors outside the layers, then one per layer: layer 0's as built, the others
    fresh (normal(0, std) where layer 0's tensor varies; copied where it is constant, as a norm's ones)."""
    outer = {name: t for name, t in tensors.items() if not LAYER.search(name)}
    first = {name: t for name, t in tensors.items() if LAYER.search(name)}
    constant = {name for name, t in first.items() if torch.all(t == t.flatten()[0])}  # a norm's ones: copied
    weight_map: dict[str, str] = {}
    total = 0
    for i in tqdm(range(-1, layers), desc="writing layers", unit="layer"):
        if i < 0:
            shard, part = "model-outer.safetensors", outer
        else:
            shard = f"model-layer-{i:03d}.safetensors"
            part = {LAYER.sub(f".layers.{i}.", name): t if i == 0 or name in constant else _fresh(t, gen, std)
                    for name, t in first.items()}
        save_file({k: v.contiguous() for k, v in part.items()}, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _fresh(like: torch.Tensor, gen: torch.Generator, std: float) -> torch.Tensor:
    return (torch.randn(like.shape, generator=gen) * std).to(like.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="5b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = ap.parse_args()
    if (args.out / "config.json").is_file():
        print(f"{args.out} already holds a checkpoint", file=sys.stderr)
        return 0
    write_random_hf(args.out, SHAPES[args.shape], args.dtype)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
