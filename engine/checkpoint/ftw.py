"""FTW: hearth's own weight format, laid out for a fast, verified start.

A directory holds ``ftw.json`` (format version, model config, tensor table, bank layout and
per-shard checksums), the checkpoint's config and tokenizer files, and binary shards. In a shard
every tensor starts on a 4 KiB boundary; the experts are stored as two banks — ``gate_up`` and
``down``, rows in global-id order — as the runtime pool holds them. Loading therefore reads byte
ranges with parallel positional reads straight into their final buffers (model parameters and the
host expert pool) and checks a CRC-32 per extent (≤ 64 MiB); nothing is looked up or reshuffled
per tensor.

Quantized models (a GGUF file, an FP8 or MXFP4 Hugging Face checkpoint) are stored as they run
(version 2): block-quantized weights as their uint8 rows of blocks with the format's name, the
expert banks as uint8 rows in each MoE layer's formats (each row without the unused tail a
narrower layer leaves in the pool). Version-1 directories (floats only) are read as before. See
docs/ftw.md.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hearth.engine import hugepages
from hearth.engine.checkpoint.errors import CheckpointError
from hearth.engine.checkpoint.loader import LoadedModel, load_config, load_model, stage_config, stage_owns
from hearth.engine.config import ConfigError, parse_dtype
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.pool import ExpertBlocks, ExpertPool
from hearth.engine.models import MoECausalLM, build_model
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.registry import block_format, dequantize

FORMAT = "hearth-ftw"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 (floats only) is a subset of version 2
INDEX = "ftw.json"
ALIGN = 4096
EXTENT = 64 << 20
DEFAULT_SHARD_BYTES = 4 << 30
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ftw", ".gguf")
_BANKS = ("gate_up", "down")

PoolFactory = Callable[[tuple, tuple, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


def is_ftw(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class _Item:
    """One region to store: a tensor, or a row range of an expert bank."""

    bank: str | None  # None for a tensor, else "gate_up" / "down"
    name: str  # the tensor's name (banks: for progress and messages)
    entry: dict  # its index fields besides shard and offset
    nbytes: int
    segments: list[memoryview]  # its bytes, in order (views: nothing is copied)


def _row_segments(bank: torch.Tensor, r0: int, r1: int, used: int) -> list[memoryview]:
    """The first ``used`` bytes of rows r0..r1 of a uint8 bank: one view where they fill the rows."""
    flat, width = _bytes_of(bank), bank.shape[1]
    if used == width:
        return [flat[r0 * width : r1 * width]]
    return [flat[r * width : r * width + used] for r in range(r0, r1)]


def _items(loaded: LoadedModel, shard_bytes: int) -> list[_Item]:
    cfg, pool = loaded.config, loaded.pool
    items = []
    for name, p in loaded.model.named_parameters():  # duplicates (tied lm_head) come once
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = p.data.contiguous()
        entry = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
        fmt = getattr(p, "block_format", None)
        if fmt is not None:
            entry["format"] = fmt.name
        items.append(_Item(None, name, entry, t.nbytes, [_bytes_of(t)]))
    for bank in _BANKS:
        t = getattr(pool, bank)
        if pool.blocks is None:  # float banks: [rows, 2I, H] / [rows, H, I], pieces across layers
            rows_per_piece = max(1, shard_bytes // max(t[0].nbytes, 1))
            for r0 in range(0, t.shape[0], rows_per_piece):
                r1 = min(r0 + rows_per_piece, t.shape[0])
                items.append(_Item(bank, f"expert bank {bank} rows {r0}..{r1}",
                                   {"shape": list(t[r0:r1].shape), "rows": [r0, r1]}, t[r0:r1].nbytes,
                                   [_bytes_of(t[r0:r1])]))
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
                                   _row_segments(t, r0, r1, used)))
    return items


def _extents(offset: int, nbytes: int) -> list[tuple[int, int]]:
    return [(offset + s, min(EXTENT, nbytes - s)) for s in range(0, nbytes, EXTENT)]


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
    spans = _extents(offset, item.nbytes)
    for (start, length), pieces in zip(spans, _cut(item.segments, [n for _, n in spans]), strict=True):
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
    banks: dict[str, list[dict]] = {bank: [] for bank in _BANKS}
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
        "dtype": _dtype_name(cfg.dtype),
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
        from hearth.engine.checkpoint.gguf_file import GGUFFile
        from hearth.engine.checkpoint.gguf_loader import gguf_hf_config
        from hearth.engine.tokenizer import load_tokenizer

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


def convert(src: str | Path, dst: str | Path, dtype: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
            show_progress: bool = False) -> Path:
    """Convert a Hugging Face checkpoint directory or a GGUF file into an FTW directory. Quantized
    weights (a GGUF file's, an FP8 or MXFP4 checkpoint's) are stored in their blocks, as they run in
    float32 (the default for them); with another ``dtype`` they are decoded to it."""
    from hearth.engine.checkpoint.gguf_loader import is_gguf, load_gguf

    if Path(dst).resolve() == Path(src).resolve():
        raise ConfigError("the FTW output directory must differ from the source checkpoint")
    if is_gguf(src):
        loaded = load_gguf(src, dtype, show_progress=show_progress, for_storage=True)
    else:
        loaded = load_model(src, dtype, show_progress=show_progress, for_storage=True)
    return write_ftw(loaded, dst, shard_bytes, show_progress)


# -- loading ---------------------------------------------------------------------------------------


@dataclass
class _Read:
    """One extent to read: ``offset`` of a shard into ``dst`` (segments, in file order)."""

    shard: int
    offset: int
    dst: list[memoryview]
    crc: int | None
    what: str

    @property
    def nbytes(self) -> int:
        return sum(len(d) for d in self.dst)


@dataclass
class _Region:
    """One stored tensor or bank piece and where its bytes go: ``segments`` (final buffers), or,
    with ``decode``, a temporary of ``nbytes`` that ``decode(temporary)`` turns into the values."""

    entry: dict
    nbytes: int
    what: str
    extents: list[tuple[int, int, int]]  # (offset, length, crc32) in the shard
    segments: list[memoryview] | None = None
    decode: Callable[[torch.Tensor], None] | None = None


def read_index(path: str | Path) -> dict:
    """Parse and check an FTW index; a foreign format or version is a clear error."""
    index_path = Path(path) / INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{index_path}: cannot read FTW index ({exc})") from exc
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path}: not an FTW index (format '{index.get('format')}')")
    if index.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{index_path}: FTW version {index.get('version')} is not supported (this hearth "
                              f"reads versions {', '.join(map(str, READABLE_VERSIONS))}); convert the checkpoint "
                              "again with `hearth convert`")
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


def _format(name: str, what: str) -> BlockFormat:
    try:
        return block_format(name)
    except KeyError:
        raise CheckpointError(f"FTW '{what}' is stored in block format '{name}', which this hearth does not "
                              "read; convert the checkpoint again with `hearth convert`") from None


def _bank_blocks(banks: dict, cfg) -> dict[int, ExpertBlocks] | None:
    """The expert banks' block formats per MoE layer (None: float banks)."""
    stored = banks.get("blocks")
    if stored is None:
        return None
    if sorted(int(layer) for layer in stored) != _all_moe_layers(cfg):
        raise CheckpointError(f"FTW bank formats name layers {sorted(map(int, stored))}, the MoE layers are "
                              f"{_all_moe_layers(cfg)}")
    return {int(layer): ExpertBlocks(_format(f["gate_up"], f"expert bank gate_up of layer {layer}"),
                                     _format(f["down"], f"expert bank down of layer {layer}"),
                                     cfg.hidden_size, cfg.moe_intermediate_size, bias=cfg.expert_bias)
            for layer, f in stored.items() if cfg.in_stage(int(layer))}


def _all_moe_layers(cfg) -> list[int]:
    """The whole model's MoE layers (a pipeline stage's config lists only its own)."""
    return [i for i, moe in enumerate(cfg.moe_layers) if moe]


def _stage_rows(cfg) -> tuple[int, int]:
    """The bank rows [lo, hi) of the whole model's banks that this stage's pool holds (its pool's row
    0 is the file's row ``lo``); every row without a layer range."""
    every, own, e = _all_moe_layers(cfg), cfg.moe_layer_ids, cfg.num_experts
    if not own:
        return 0, 0
    lo = every.index(own[0]) * e
    return lo, lo + len(own) * e


def _adopt_block_tensors(index: dict, model: MoECausalLM, wanted: dict[str, torch.nn.Parameter],
                         keep: bool) -> dict[str, BlockFormat]:
    """Check every tensor stored in blocks against its float parameter; with ``keep`` put a uint8
    block weight in its place (and let fused layers fuse them), to be read into. Returns the
    formats by tensor name."""
    from hearth.engine.checkpoint.gguf_loader import adopt_blocks, replace_parameter
    from hearth.engine.ops import block_weight

    formats = {}
    for name, param in wanted.items():
        entry = index["tensors"][name]
        if "format" not in entry:
            continue
        fmt = formats[name] = _format(entry["format"], name)
        whole_blocks = param.dim() == 2 and param.shape[1] % fmt.block_elems == 0
        want = [param.shape[0], fmt.row_bytes(param.shape[1])] if whole_blocks else None
        if list(entry["shape"]) != want:
            raise CheckpointError(f"FTW tensor '{name}' has shape {entry['shape']} in {fmt.name}, expected "
                                  f"{want} for a weight of shape {list(param.shape)}")
        if keep:
            replace_parameter(model, param, block_weight(hugepages.empty(*want, dtype=torch.uint8), fmt))
    if keep and formats:
        adopt_blocks(model)
    return formats


def _region(entry: dict, nbytes: int, what: str, crcs: dict) -> _Region:
    extents = []
    for start, length in _extents(entry["offset"], nbytes):
        known = crcs.get((entry["shard"], start))
        if known is None or known[0] != length:
            raise CheckpointError(f"FTW index has no checksum extent for '{what}' at byte {start}")
        extents.append((start, length, known[1]))
    return _Region(entry, nbytes, what, extents)


def _decoder(dst: torch.Tensor, fmt: BlockFormat, rows: int, cols: int) -> Callable[[torch.Tensor], None]:
    """Decode a temporary of ``rows`` rows of blocks (``cols`` elements each) into ``dst``."""
    return lambda raw: dst.copy_(dequantize(raw.view(rows, -1), fmt, cols).reshape(dst.shape))


def _plan_regions(index: dict, model: MoECausalLM, pool: ExpertPool, cfg, keep_dense: bool,
                  bank_blocks: dict[int, ExpertBlocks] | None, read_banks: bool = True) -> list[_Region]:
    crcs = {(s, e[0]): (e[1], e[2]) for s, shard in enumerate(index["shards"]) for e in shard["extents"]}
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    wanted = {n: p for n, p in model.named_parameters() if n not in tied}
    missing = sorted(set(wanted) - set(index["tensors"]))
    extra = sorted(set(index["tensors"]) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"FTW tensor table does not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    wanted = {n: p for n, p in wanted.items() if stage_owns(n, cfg)}  # a pipeline stage reads its own
    float_shapes = {n: tuple(p.shape) for n, p in wanted.items()}
    formats = _adopt_block_tensors(index, model, wanted, keep_dense)
    params = {n: p for n, p in model.named_parameters() if n in wanted}  # block weights where kept
    regions: list[_Region] = []
    for name, param in params.items():
        entry, fmt = index["tensors"][name], formats.get(name)
        if fmt is None:
            if list(entry["shape"]) != list(param.shape):
                raise CheckpointError(f"FTW tensor '{name}' has shape {entry['shape']}, expected {list(param.shape)}")
            stored = entry.get("dtype", index["dtype"])
            if stored != _dtype_name(param.dtype):
                raise CheckpointError(f"FTW tensor '{name}' is stored as {stored}, expected {_dtype_name(param.dtype)}")
            region = _region(entry, param.nbytes, name, crcs)
            region.segments = [_bytes_of(param.data)]
        else:
            nbytes = math.prod(entry["shape"])
            region = _region(entry, nbytes, name, crcs)
            if param.dtype == torch.uint8:  # kept: straight into the block weight
                region.segments = [_bytes_of(param.data)]
            else:
                rows, cols = float_shapes[name]
                region.decode = _decoder(param.data, fmt, rows, cols)
        regions.append(region)
    i, h, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    every = _all_moe_layers(cfg)
    lo, hi = _stage_rows(cfg) if cfg.layer_range is not None else (0, len(every) * e)
    for bank in _BANKS:
        t = getattr(pool, bank)
        covered = 0
        for piece in index["banks"][bank]:
            f0, f1 = piece["rows"]  # rows of the whole model's bank
            what = f"expert bank {bank} rows {f0}..{f1}"
            a, b = max(f0, lo), min(f1, hi)  # the part this pool holds
            if a >= b:
                continue
            covered += b - a
            r0, r1 = f0 - lo, f1 - lo  # the piece's rows in this pool (outside it where only a part is ours)
            if bank_blocks is None:  # float banks
                row_shape = list(t.shape[1:])
                if list(piece["shape"]) != [f1 - f0, *row_shape]:
                    raise CheckpointError(f"FTW tensor '{what}' has shape {piece['shape']}, expected "
                                          f"{[f1 - f0, *row_shape]}")
                if not read_banks:
                    continue
                region = _region(piece, (f1 - f0) * t[0].nbytes, what, crcs)
                if (a, b) == (f0, f1):
                    region.segments = [_bytes_of(t[r0:r1])]
                else:  # a piece across a stage boundary: read whole, keep this stage's rows
                    region.decode = _rows_copier(t, a - lo, b - lo, a - f0, f1 - f0)
                regions.append(region)
                continue
            rank = f0 // e
            if not (0 <= rank < len(every) and f0 < f1 <= (rank + 1) * e):
                raise CheckpointError(f"FTW '{what}' does not lie within one MoE layer's rows")
            blocks = bank_blocks[every[rank]]
            used = blocks.gate_up_row_bytes if bank == "gate_up" else blocks.down_row_bytes
            if list(piece["shape"]) != [r1 - r0, used]:
                raise CheckpointError(f"FTW tensor '{what}' has shape {piece['shape']}, expected {[r1 - r0, used]}")
            if not read_banks:
                continue
            region = _region(piece, (r1 - r0) * used, what, crcs)
            if t.dtype == torch.uint8:  # kept: each row's blocks at the start of its bank row
                region.segments = _row_segments(t, r0, r1, used)
            elif blocks.bias:
                raise CheckpointError(f"FTW '{what}': experts with biases in blocks are read as stored only (float32 "
                                      "compute, in-process CPU experts); convert the original checkpoint instead")
            elif bank == "gate_up":
                region.decode = _decoder(t[r0:r1], blocks.gate_up, (r1 - r0) * 2 * i, h)
            else:
                region.decode = _decoder(t[r0:r1], blocks.down, (r1 - r0) * h, i)
            regions.append(region)
        if covered != t.shape[0]:
            raise CheckpointError(f"FTW bank {bank} covers {covered} expert rows, the model has {t.shape[0]}")
    return regions


def _rows_copier(dst: torch.Tensor, d0: int, d1: int, s0: int, rows: int) -> Callable[[torch.Tensor], None]:
    """Copy rows [s0, s0 + d1 - d0) of a temporary holding ``rows`` rows of ``dst``'s kind into
    ``dst[d0:d1]``."""
    return lambda raw: dst[d0:d1].copy_(raw.view(dst.dtype).view(rows, *dst.shape[1:])[s0 : s0 + d1 - d0])


def _cut(segments: list[memoryview], lengths: list[int]) -> list[list[memoryview]]:
    """Split the bytes of ``segments`` (in order) into consecutive pieces of ``lengths``."""
    out, i, skip = [], 0, 0
    for length in lengths:
        piece = []
        while length:
            seg = segments[i]
            take = min(len(seg) - skip, length)
            if take:
                piece.append(seg[skip : skip + take])
            length -= take
            skip += take
            if skip == len(seg):
                i, skip = i + 1, 0
        out.append(piece)
    return out


def _reads(region: _Region, segments: list[memoryview]) -> list[_Read]:
    pieces = _cut(segments, [length for _, length, _ in region.extents])
    return [_Read(region.entry["shard"], start, dst, crc, region.what)
            for (start, _, crc), dst in zip(region.extents, pieces, strict=True)]


try:
    _IOV_MAX = max(1, min(os.sysconf("SC_IOV_MAX"), 1024))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024


def _pread_into(fd: int, dst: list[memoryview], offset: int) -> int:
    """Read ``offset`` onwards into the segments ``dst`` (scattered: ``preadv``); returns the bytes read."""
    done, i, skip = 0, 0, 0
    while i < len(dst):
        n = os.preadv(fd, [dst[i][skip:], *dst[i + 1 : i + _IOV_MAX]], offset + done)
        if n <= 0:
            break
        done += n
        while n and i < len(dst):
            left = len(dst[i]) - skip
            if n >= left:
                n -= left
                i, skip = i + 1, 0
            else:
                skip, n = skip + n, 0
    return done


def load_ftw(path: str | Path, dtype: str | torch.dtype | None = None, pool_factory: PoolFactory | None = None,
             verify: bool = True, show_progress: bool = False, threads: int | None = None,
             filled_pool: tuple[torch.Tensor, torch.Tensor] | None = None, keep_blocks: bool = True,
             layers: tuple[int, int] | None = None) -> LoadedModel:
    """Load an FTW directory. ``pool_factory(gate_up_shape, down_shape, dtype)`` supplies the expert
    bank storage (e.g. a shared-memory segment); ``filled_pool`` is an already filled one (a
    restarted executor re-attaching to the host pool): its banks are not read again.
    ``verify=False`` skips the checksums. ``layers``: only the tensors and expert rows of the
    pipeline stage holding layers [first, end).

    Weights stored in blocks stay in them (as a GGUF file's or a quantized checkpoint's would) where
    the native kernels run and ``keep_blocks``; the experts only in a pool of the loader's own (a
    ``pool_factory``'s or a filled pool holds floats). Elsewhere they are decoded as they land."""
    from hearth.engine.checkpoint.gguf_loader import blocks_can_stay

    path = Path(path)
    index = read_index(path)
    stored = getattr(torch, index["dtype"])
    if dtype not in (None, "auto") and parse_dtype({}, dtype) != stored:
        raise ConfigError(f"{path} stores {index['dtype']} weights; convert it again with --dtype to use {dtype}")
    _, cfg = load_config(path, stored)
    if layers is not None:
        if filled_pool is not None:
            raise ConfigError("a pipeline stage reads its own layers; it does not attach to a shared pool")
        cfg = stage_config(cfg, layers)
    banks = index["banks"]
    if list(banks["moe_layers"]) != _all_moe_layers(cfg) or banks["num_experts"] != cfg.num_experts:
        raise CheckpointError(f"{path}: FTW bank layout does not match config.json")
    files = _check_shards(path, index)
    bank_blocks = _bank_blocks(banks, cfg)
    keep = keep_blocks and blocks_can_stay(cfg)
    keep_experts = bank_blocks is not None and keep and pool_factory is None and filled_pool is None
    if filled_pool is not None and filled_pool[0].dtype != cfg.dtype:
        raise CheckpointError(f"the shared expert pool holds {filled_pool[0].dtype}, the checkpoint {cfg.dtype}")
    storage = filled_pool if filled_pool is not None else pool_factory(*ExpertPool.bank_shapes(cfg), cfg.dtype) \
        if pool_factory else None
    pool = ExpertPool(cfg, storage, bank_blocks if keep_experts else None)
    model = build_model(cfg, LocalExpertBackend(pool, cfg.hidden_act))
    regions = _plan_regions(index, model, pool, cfg, keep, bank_blocks, read_banks=filled_pool is None)
    fds = [os.open(f, os.O_RDONLY) for f in files]
    bar = tqdm(total=sum(r.nbytes for r in regions), unit="B", unit_scale=True, desc="loading FTW",
               disable=not show_progress)

    def run(r: _Read) -> None:
        want = r.nbytes
        got = _pread_into(fds[r.shard], r.dst, r.offset)
        shard = index["shards"][r.shard]["file"]
        if got != want:
            raise CheckpointError(f"FTW shard {shard}: short read in '{r.what}' ({got} of {want} bytes)")
        if verify:
            crc = 0
            for d in r.dst:
                crc = zlib.crc32(d, crc)
            if crc != r.crc:
                raise CheckpointError(f"FTW shard {shard}: checksum mismatch in '{r.what}' (bytes {r.offset}.."
                                      f"{r.offset + want}); the file is corrupt, convert it again")
        bar.update(want)

    def read_all(ex: ThreadPoolExecutor, reads: list[_Read]) -> None:
        for fut in [ex.submit(run, r) for r in reads]:
            fut.result()

    try:
        with ThreadPoolExecutor(threads or min(8, 2 * (os.cpu_count() or 1))) as ex:
            # Straight into the final buffers, all at once; then what is decoded, one region at a
            # time (a temporary of at most one piece).
            read_all(ex, [read for r in regions if r.decode is None for read in _reads(r, r.segments)])
            for r in regions:
                if r.decode is not None:
                    raw = torch.empty(r.nbytes, dtype=torch.uint8)
                    read_all(ex, _reads(r, [_bytes_of(raw)]))
                    r.decode(raw)
    finally:
        bar.close()
        for fd in fds:
            os.close(fd)
    model.eval()
    return LoadedModel(config=cfg, model=model, pool=pool, model_dir=path)


def load_checkpoint(path: str | Path, dtype: str | torch.dtype | None = None, pool_factory: PoolFactory | None = None,
                    verify: bool = True, show_progress: bool = False,
                    filled_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
                    keep_blocks: bool = True, layers: tuple[int, int] | None = None) -> LoadedModel:
    """Load an FTW directory, a GGUF file, or a Hugging Face directory (converted in memory to the
    same layout). ``keep_blocks``: quantized weights (a GGUF file's, an FP8 / MXFP4 checkpoint's, or
    an FTW directory's stored in blocks) may stay in their blocks (not when CPU worker processes,
    which compute float experts, share the pool)."""
    from hearth.engine.checkpoint.gguf_loader import is_gguf, load_gguf

    if is_gguf(path):
        if filled_pool is not None:
            raise ConfigError("re-attaching to a filled shared expert pool needs an FTW checkpoint")
        return load_gguf(path, dtype, show_progress=show_progress, pool_factory=pool_factory, keep_blocks=keep_blocks,
                         layers=layers)
    if is_ftw(path):
        return load_ftw(path, dtype, pool_factory, verify, show_progress, filled_pool=filled_pool,
                        keep_blocks=keep_blocks, layers=layers)
    if filled_pool is not None:
        raise ConfigError("re-attaching to a filled shared expert pool needs an FTW checkpoint "
                          "(convert it with `hearth convert`)")
    return load_model(path, dtype, show_progress=show_progress, pool_factory=pool_factory, keep_blocks=keep_blocks,
                      layers=layers)
