"""FTW: hearth's own weight format, laid out for a fast, verified start.

A directory holds ``ftw.json`` (format version, model config, tensor table, bank layout and
per-shard checksums), the checkpoint's config and tokenizer files, and binary shards. In a shard
every tensor starts on a 4 KiB boundary; the experts are stored as two banks — ``gate_up``
[rows, 2I, H] and ``down`` [rows, H, I] in global-id order — exactly as the runtime pool holds them.
Loading therefore reads byte ranges with parallel positional reads straight into their final
buffers (model parameters and the host expert pool) and checks a CRC-32 per extent (≤ 64 MiB);
nothing is looked up or reshuffled per tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hearth.engine.config import ConfigError, parse_dtype
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.loader import CheckpointError, LoadedModel, load_config, load_model
from hearth.engine.models import MoECausalLM, build_model

FORMAT = "hearth-ftw"
VERSION = 1
INDEX = "ftw.json"
ALIGN = 4096
EXTENT = 64 << 20
DEFAULT_SHARD_BYTES = 4 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ftw")

PoolFactory = Callable[[tuple, tuple, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


def is_ftw(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


@dataclass
class _Item:
    """One region to store: a tensor, or a row range of an expert bank."""

    key: str  # tensor name, or "bank:gate_up:r0:r1"
    tensor: torch.Tensor


def _items(loaded: LoadedModel, shard_bytes: int) -> list[_Item]:
    cfg = loaded.config
    items = []
    for name, p in loaded.model.named_parameters():  # duplicates (tied lm_head) come once
        if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            items.append(_Item(name, p.data.contiguous()))
    for bank in ("gate_up", "down"):
        t = getattr(loaded.pool, bank)
        rows_per_piece = max(1, shard_bytes // max(t[0].nbytes, 1))
        for r0 in range(0, t.shape[0], rows_per_piece):
            r1 = min(r0 + rows_per_piece, t.shape[0])
            items.append(_Item(f"bank:{bank}:{r0}:{r1}", t[r0:r1]))
    return items


def _extents(offset: int, nbytes: int) -> list[tuple[int, int]]:
    return [(offset + s, min(EXTENT, nbytes - s)) for s in range(0, nbytes, EXTENT)]


def _plan(items: list[_Item], shard_bytes: int) -> list[list[tuple[_Item, int]]]:
    """Assign every item a shard and an aligned offset: [[(item, offset), ...] per shard]."""
    shards: list[list[tuple[_Item, int]]] = [[]]
    offset = 0
    for item in items:
        aligned = -(-offset // ALIGN) * ALIGN
        if shards[-1] and aligned + item.tensor.nbytes > shard_bytes:
            shards.append([])
            aligned = 0
        shards[-1].append((item, aligned))
        offset = aligned + item.tensor.nbytes
    return shards


def write_ftw(loaded: LoadedModel, dst: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES,
              show_progress: bool = False) -> Path:
    """Write ``loaded`` (model + expert pool) as an FTW directory; returns its index path."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    items = _items(loaded, shard_bytes)
    bar = tqdm(total=sum(i.tensor.nbytes for i in items), unit="B", unit_scale=True, desc="writing FTW",
               disable=not show_progress)
    shards: list[dict] = []
    tensors: dict[str, dict] = {}
    banks: dict[str, list[dict]] = {"gate_up": [], "down": []}
    for shard_no, placed in enumerate(_plan(items, shard_bytes)):
        name = f"weights-{shard_no:05d}.ftw"
        extents = []
        with open(dst / name, "wb") as f:
            for item, offset in placed:
                f.seek(offset)
                data = _bytes_of(item.tensor)
                for start, length in _extents(offset, item.tensor.nbytes):
                    piece = data[start - offset : start - offset + length]
                    f.write(piece)
                    extents.append([start, length, zlib.crc32(piece)])
                    bar.update(length)
                entry = {"shard": shard_no, "offset": offset, "shape": list(item.tensor.shape)}
                if item.key.startswith("bank:"):
                    _, bank, r0, r1 = item.key.split(":")
                    banks[bank].append({**entry, "rows": [int(r0), int(r1)]})
                else:
                    tensors[item.key] = entry
            size = f.tell()
        shards.append({"file": name, "bytes": size, "checksum": "crc32-per-extent", "extents": extents})
    bar.close()
    cfg = loaded.config
    index = {
        "format": FORMAT, "version": VERSION, "alignment": ALIGN, "extent_bytes": EXTENT,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "config": json.loads((loaded.model_dir / "config.json").read_text()),
        "banks": {"order": "global id (layer * num_experts + expert), MoE layers only",
                  "moe_layers": list(cfg.moe_layer_ids), "num_experts": cfg.num_experts, **banks},
        "tensors": tensors, "shards": shards,
    }
    _copy_side_files(loaded.model_dir, dst)
    path = dst / INDEX
    path.write_text(json.dumps(index, indent=1))
    return path


def _copy_side_files(src: Path, dst: Path) -> None:
    """config.json, tokenizer and template files: everything except weights."""
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != "model.safetensors.index.json":
            shutil.copy2(p, dst / p.name)


def convert(src: str | Path, dst: str | Path, dtype: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
            show_progress: bool = False) -> Path:
    """Convert a Hugging Face checkpoint directory into an FTW directory."""
    if Path(dst).resolve() == Path(src).resolve():
        raise ConfigError("the FTW output directory must differ from the source checkpoint")
    loaded = load_model(src, dtype, show_progress=show_progress, keep_blocks=False)  # FTW holds floats
    return write_ftw(loaded, dst, shard_bytes, show_progress)


# -- loading ---------------------------------------------------------------------------------------


@dataclass
class _Read:
    """One extent to read: ``length`` bytes at ``offset`` of a shard into ``dst``."""

    shard: int
    offset: int
    dst: memoryview
    crc: int | None
    what: str


def read_index(path: str | Path) -> dict:
    """Parse and check an FTW index; a foreign format or version is a clear error."""
    index_path = Path(path) / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_path}: cannot read FTW index ({exc})") from exc
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path}: not an FTW index (format '{index.get('format')}')")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{index_path}: FTW version {index.get('version')} is not supported (this hearth "
                              f"reads version {VERSION}); convert the checkpoint again with `hearth convert`")
    return index


def _check_shards(path: Path, index: dict) -> list[Path]:
    files = []
    for shard in index["shards"]:
        f = path / shard["file"]
        if not f.is_file():
            raise CheckpointError(f"FTW shard {shard['file']} is missing from {path}")
        size = f.stat().st_size
        if size != shard["bytes"]:
            what = "truncated" if size < shard["bytes"] else "longer than its index says"
            raise CheckpointError(f"FTW shard {shard['file']} is {what}: {size} bytes, expected {shard['bytes']}")
        files.append(f)
    return files


def _plan_reads(index: dict, model: MoECausalLM, pool: ExpertPool, cfg, read_banks: bool = True) -> list[_Read]:
    crcs = {(s, e[0]): (e[1], e[2]) for s, shard in enumerate(index["shards"]) for e in shard["extents"]}
    wanted = {n: p for n, p in model.named_parameters() if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(set(wanted) - set(index["tensors"]))
    extra = sorted(set(index["tensors"]) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"FTW tensor table does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    regions: list[tuple[dict, torch.Tensor, str]] = []
    for name, p in wanted.items():
        regions.append((index["tensors"][name], p.data, name))
    for bank in ("gate_up", "down"):
        t = getattr(pool, bank)
        covered = 0
        for piece in index["banks"][bank]:
            r0, r1 = piece["rows"]
            if read_banks:
                regions.append((piece, t[r0:r1], f"expert bank {bank} rows {r0}..{r1}"))
            covered += r1 - r0
        if covered != t.shape[0]:
            raise CheckpointError(f"FTW bank {bank} covers {covered} expert rows, the model has {t.shape[0]}")
    reads = []
    for entry, dst, what in regions:
        if list(entry["shape"]) != list(dst.shape):
            raise CheckpointError(f"FTW tensor '{what}' has shape {entry['shape']}, expected {list(dst.shape)}")
        data = _bytes_of(dst)
        for start, length in _extents(entry["offset"], dst.nbytes):
            known = crcs.get((entry["shard"], start))
            if known is None or known[0] != length:
                raise CheckpointError(f"FTW index has no checksum extent for '{what}' at byte {start}")
            reads.append(_Read(entry["shard"], start, data[start - entry["offset"]:][:length], known[1], what))
    return reads


def _pread_into(fd: int, dst: memoryview, offset: int) -> int:
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def load_ftw(path: str | Path, dtype: str | torch.dtype | None = None, pool_factory: PoolFactory | None = None,
             verify: bool = True, show_progress: bool = False, threads: int | None = None,
             filled_pool: tuple[torch.Tensor, torch.Tensor] | None = None) -> LoadedModel:
    """Load an FTW directory. ``pool_factory(gate_up_shape, down_shape, dtype)`` supplies the expert
    bank storage (e.g. a shared-memory segment); ``filled_pool`` is an already filled one (a
    restarted executor re-attaching to the host pool): its banks are not read again.
    ``verify=False`` skips the checksums."""
    path = Path(path)
    index = read_index(path)
    stored = getattr(torch, index["dtype"])
    if dtype not in (None, "auto") and parse_dtype({}, dtype) != stored:
        raise ConfigError(f"{path} stores {index['dtype']} weights; convert it again with --dtype to use {dtype}")
    _, cfg = load_config(path, stored)
    banks = index["banks"]
    if list(banks["moe_layers"]) != list(cfg.moe_layer_ids) or banks["num_experts"] != cfg.num_experts:
        raise CheckpointError(f"{path}: FTW bank layout does not match config.json")
    files = _check_shards(path, index)
    shapes = ExpertPool.bank_shapes(cfg)
    if filled_pool is not None and filled_pool[0].dtype != cfg.dtype:
        raise CheckpointError(f"the shared expert pool holds {filled_pool[0].dtype}, the checkpoint {cfg.dtype}")
    storage = filled_pool if filled_pool is not None else pool_factory(*shapes, cfg.dtype) if pool_factory else None
    pool = ExpertPool(cfg, storage)
    model = build_model(cfg, LocalExpertBackend(pool, cfg.hidden_act))
    reads = _plan_reads(index, model, pool, cfg, read_banks=filled_pool is None)
    fds = [os.open(f, os.O_RDONLY) for f in files]
    bar = tqdm(total=sum(len(r.dst) for r in reads), unit="B", unit_scale=True, desc="loading FTW",
               disable=not show_progress)

    def run(r: _Read) -> None:
        got = _pread_into(fds[r.shard], r.dst, r.offset)
        shard = index["shards"][r.shard]["file"]
        if got != len(r.dst):
            raise CheckpointError(f"FTW shard {shard}: short read in '{r.what}' ({got} of {len(r.dst)} bytes)")
        if verify and zlib.crc32(r.dst) != r.crc:
            raise CheckpointError(f"FTW shard {shard}: checksum mismatch in '{r.what}' (bytes {r.offset}.."
                                  f"{r.offset + len(r.dst)}); the file is corrupt, convert it again")
        bar.update(len(r.dst))

    try:
        with ThreadPoolExecutor(threads or min(8, 2 * (os.cpu_count() or 1))) as ex:
            for fut in [ex.submit(run, r) for r in reads]:
                fut.result()
    finally:
        bar.close()
        for fd in fds:
            os.close(fd)
    model.eval()
    return LoadedModel(config=cfg, model=model, pool=pool, model_dir=path)


def load_checkpoint(path: str | Path, dtype: str | torch.dtype | None = None, pool_factory: PoolFactory | None = None,
                    verify: bool = True, show_progress: bool = False,
                    filled_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
                    keep_blocks: bool = True) -> LoadedModel:
    """Load an FTW directory, a GGUF file, or a Hugging Face directory (converted in memory to the
    same layout). ``keep_blocks``: a GGUF file's or an FP8 / MXFP4 checkpoint's quantized weights
    may stay in their blocks (not when CPU worker processes, which compute float experts, share the
    pool)."""
    from hearth.engine.gguf_loader import is_gguf, load_gguf

    if is_gguf(path):
        if filled_pool is not None:
            raise ConfigError("re-attaching to a filled shared expert pool needs an FTW checkpoint")
        return load_gguf(path, dtype, show_progress=show_progress, pool_factory=pool_factory, keep_blocks=keep_blocks)
    if is_ftw(path):
        return load_ftw(path, dtype, pool_factory, verify, show_progress, filled_pool=filled_pool)
    if filled_pool is not None:
        raise ConfigError("re-attaching to a filled shared expert pool needs an FTW checkpoint "
                          "(convert it with `hearth convert`)")
    return load_model(path, dtype, show_progress=show_progress, pool_factory=pool_factory, keep_blocks=keep_blocks)
