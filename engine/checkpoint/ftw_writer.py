"""Write an FTW directory (:mod:`.ftw` describes the format and reads it): every tensor and expert
bank piece of a loaded model, each on a 4 KiB boundary of a shard, with a CRC-32 per extent, and
the checkpoint's config and tokenizer files beside them."""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from hearth.engine.checkpoint.common import LoadedModel
from hearth.engine.checkpoint.ftw import (
    ALIGN,
    BANKS,
    DEFAULT_SHARD_BYTES,
    EXTENT,
    FORMAT,
    INDEX,
    VERSION,
    bytes_of,
    cut,
    dtype_name,
    extents_of,
    row_segments,
)
from hearth.engine.checkpoint.gguf_reader import GGUFFile, gguf_hf_config
from hearth.engine.text.tokenizer import load_tokenizer

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ftw", ".gguf")


@dataclass
class _Item:
    """One region to store: a tensor, or a row range of an expert bank."""

    bank: str | None  # None for a tensor, else "gate_up" / "down"
    name: str  # the tensor's name (banks: for progress and messages)
    entry: dict  # its index fields besides shard and offset
    nbytes: int
    segments: list[memoryview]  # its bytes, in order (views: nothing is copied)


def _items(loaded: LoadedModel, shard_bytes: int) -> list[_Item]:
    cfg, pool = loaded.config, loaded.pool
    items = []
    for name, p in loaded.model.named_parameters():  # duplicates (tied lm_head) come once
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = p.data.contiguous()
        entry = {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}
        fmt = getattr(p, "block_format", None)
        if fmt is not None:
            entry["format"] = fmt.name
        items.append(_Item(None, name, entry, t.nbytes, [bytes_of(t)]))
    for bank in BANKS:
        t = getattr(pool, bank)
        if pool.blocks is None:  # float banks: [rows, 2I, H] / [rows, H, I], pieces across layers
            rows_per_piece = max(1, shard_bytes // max(t[0].nbytes, 1))
            for r0 in range(0, t.shape[0], rows_per_piece):
                r1 = min(r0 + rows_per_piece, t.shape[0])
                items.append(_Item(bank, f"expert bank {bank} rows {r0}..{r1}",
                                   {"shape": list(t[r0:r1].shape), "rows": [r0, r1]}, t[r0:r1].nbytes,
                                   [bytes_of(t[r0:r1])]))
            continue
        for layer in pool.moe_layer_ids:  # blocks: each layer's rows as wide as its formats make them
            blocks = pool.layer_blocks(layer)
            used = blocks.gate_up_row_bytes if bank == "gate_up" else blocks.down_row_bytes  # (with any biases)
            base = pool.layer_rows(layer)
            rows_per_piece = max(1, shard_bytes // max(used, 1))
            for r0 in range(base, base + pool.num_experts, rows_per_piece):
                r1 = min(r0 + rows_per_piece, base + pool.num_experts)
                items.append(_Item(bank, f"expert bank {bank} rows {r0}..{r1}",
                                   {"shape": [r1 - r0, used], "rows": [r0, r1]}, (r1 - r0) * used,
                                   row_segments(t, r0, r1, used)))
    return items

def _plan(items: list[_Item], shard_bytes: int) -> list[list[tuple[_Item, int]]]:
    """Assign every item a shard and an aligned offset: [[(item, offset), ...] per shard]."""
    shards: list[list[tuple[_Item, int]]] = [[]]
    offset = 0
    for item in items:
        aligned = -(-offset // ALIGN) * ALIGN
        if shards[-1] and aligned + item.nbytes > shard_bytes:
            shards.append([])
            aligned = 0
        shards[-1].append((item, aligned))
        offset = aligned + item.nbytes
    return shards


def _write_item(f, item: _Item, offset: int, bar) -> list[list[int]]:
    """Write ``item`` at ``offset``; its extents [[offset, length, crc32], …] (cut every EXTENT bytes
    from ``offset``, as the reader reads them)."""
    if sum(len(seg) for seg in item.segments) != item.nbytes:
        raise RuntimeError(f"FTW writer: '{item.name}' does not hold the {item.nbytes} bytes its entry says")
    f.seek(offset)
    extents: list[list[int]] = []
    spans = extents_of(offset, item.nbytes)
    for (start, length), pieces in zip(spans, cut(item.segments, [n for _, n in spans]), strict=True):
        crc = 0
        for piece in pieces:
            f.write(piece)
            crc = zlib.crc32(piece, crc)
            bar.update(len(piece))
        extents.append([start, length, crc])
    return extents


def write_ftw(loaded: LoadedModel, dst: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES,
              show_progress: bool = False) -> Path:
    """Write ``loaded`` (model + expert pool, floats or blocks as they run) as an FTW directory;
    returns its index path."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    items = _items(loaded, shard_bytes)
    bar = tqdm(total=sum(i.nbytes for i in items), unit="B", unit_scale=True, desc="writing FTW",
               disable=not show_progress)
    shards: list[dict] = []
    tensors: dict[str, dict] = {}
    banks: dict[str, list[dict]] = {bank: [] for bank in BANKS}
    for shard_no, placed in enumerate(_plan(items, shard_bytes)):
        name = f"weights-{shard_no:05d}.ftw"
        extents = []
        with open(dst / name, "wb") as f:
            for item, offset in placed:
                extents += _write_item(f, item, offset, bar)
                entry = {"shard": shard_no, "offset": offset, **item.entry}
                if item.bank is not None:
                    banks[item.bank].append(entry)
                else:
                    tensors[item.name] = entry
            size = f.tell()
        shards.append({"file": name, "bytes": size, "checksum": "crc32-per-extent", "extents": extents})
    bar.close()
    cfg, pool = loaded.config, loaded.pool
    bank_index = {"order": "global id (layer * num_experts + expert), MoE layers only",
                  "moe_layers": list(cfg.moe_layer_ids), "num_experts": cfg.num_experts}
    if pool.blocks is not None:
        bank_index["blocks"] = {str(layer): {"gate_up": b.gate_up.name, "down": b.down.name}
                                for layer, b in sorted(pool.blocks.items())}
    index = {
        "format": FORMAT, "version": VERSION, "alignment": ALIGN, "extent_bytes": EXTENT,
        "dtype": dtype_name(cfg.dtype),
        "config": _side_files(loaded.model_dir, dst),
        "banks": {**bank_index, **banks},
        "tensors": tensors, "shards": shards,
    }
    path = dst / INDEX
    path.write_text(json.dumps(index, indent=1))
    return path


def _side_files(src: Path, dst: Path) -> dict:
    """Write the config and tokenizer files beside the shards; returns the config. A checkpoint
    directory's are copied (config.json, tokenizer and template files: everything except weights);
    a GGUF file's come from its metadata: config.json from transformers' reading of it (completed as
    the GGUF loader completes it), the tokenizer and chat template saved by transformers."""
    if src.is_file():
        config = json.loads(gguf_hf_config(GGUFFile(src)).to_json_string(use_diff=False))
        (dst / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = load_tokenizer(src)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(dst))
        return config
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != "model.safetensors.index.json":
            shutil.copy2(p, dst / p.name)
    return json.loads((src / "config.json").read_text())
