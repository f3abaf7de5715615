"""FTW: hearth's own weight format, laid out for a fast, verified start (read here, written by
:mod:`.ftw_writer`).

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
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from hearth.engine import hugepages
from hearth.engine.checkpoint.common import (
    CheckpointError,
    LoadedModel,
    PoolFactory,
    adopt_blocks,
    blocks_can_stay,
    replace_parameter,
    stage_config,
    stage_owns,
)
from hearth.engine.checkpoint.hf import load_hf_config
from hearth.engine.config import ConfigError, parse_dtype
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.pool import ExpertBlocks, ExpertPool
from hearth.engine.models import MoECausalLM, build_model
from hearth.engine.ops import block_weight
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.registry import block_format, dequantize

FORMAT = "hearth-ftw"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 (floats only) is a subset of version 2
INDEX = "ftw.json"
ALIGN = 4096
EXTENT = 64 << 20
DEFAULT_SHARD_BYTES = 4 << 30
BANKS = ("gate_up", "down")  # the expert banks, in the order they are stored


def is_ftw(path: str | Path) -> bool:
    """Whether ``path`` is an FTW directory (it holds an index)."""
    return (Path(path) / INDEX).is_file()


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how the index names a dtype."""
    return str(dtype).removeprefix("torch.")


def row_segments(bank: torch.Tensor, r0: int, r1: int, used: int) -> list[memoryview]:
    """The first ``used`` bytes of rows r0..r1 of a uint8 bank: one view where they fill the rows."""
    flat, width = bytes_of(bank), bank.shape[1]
    if used == width:
        return [flat[r0 * width : r1 * width]]
    return [flat[r * width : r * width + used] for r in range(r0, r1)]


def extents_of(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each checksummed extent of ``nbytes`` stored at ``offset``."""
    return [(offset + s, min(EXTENT, nbytes - s)) for s in range(0, nbytes, EXTENT)]


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
    for start, length in extents_of(entry["offset"], nbytes):
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
    """Every region to read and where its bytes go: the model's tensors, then the expert banks
    (checked, but not read, without ``read_banks``). Any mismatch with the model is an error."""
    crcs = {(s, e[0]): (e[1], e[2]) for s, shard in enumerate(index["shards"]) for e in shard["extents"]}
    regions = _tensor_regions(index, model, cfg, keep_dense, crcs)
    every = _all_moe_layers(cfg)
    held = _stage_rows(cfg) if cfg.layer_range is not None else (0, len(every) * cfg.num_experts)
    for bank in BANKS:
        regions += _bank_regions(index, bank, getattr(pool, bank), cfg, bank_blocks, held, crcs, read_banks)
    return regions


def _tensor_regions(index: dict, model: MoECausalLM, cfg, keep_dense: bool, crcs: dict) -> list[_Region]:
    """The model's tensors (a pipeline stage's own): floats straight into their parameters, blocks
    into their block weights where kept, else decoded."""
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
            if stored != dtype_name(param.dtype):
                raise CheckpointError(f"FTW tensor '{name}' is stored as {stored}, expected {dtype_name(param.dtype)}")
            region = _region(entry, param.nbytes, name, crcs)
            region.segments = [bytes_of(param.data)]
        else:
            region = _region(entry, math.prod(entry["shape"]), name, crcs)
            if param.dtype == torch.uint8:  # kept: straight into the block weight
                region.segments = [bytes_of(param.data)]
            else:
                rows, cols = float_shapes[name]
                region.decode = _decoder(param.data, fmt, rows, cols)
        regions.append(region)
    return regions


def _bank_regions(index: dict, bank: str, t: torch.Tensor, cfg, bank_blocks: dict[int, ExpertBlocks] | None,
                  held: tuple[int, int], crcs: dict, read: bool) -> list[_Region]:
    """One expert bank's pieces that overlap the rows [lo, hi) of the whole model's bank this pool
    holds (``held``); the pool's rows must be covered exactly once."""
    lo, hi = held
    regions: list[_Region] = []
    covered = 0
    for piece in index["banks"][bank]:
        f0, f1 = piece["rows"]  # rows of the whole model's bank
        what = f"expert bank {bank} rows {f0}..{f1}"
        a, b = max(f0, lo), min(f1, hi)  # the part this pool holds
        if a >= b:
            continue
        covered += b - a
        if bank_blocks is None:
            region = _float_piece(piece, what, t, lo, (a, b), crcs, read)
        else:
            region = _block_piece(piece, what, bank, t, lo, cfg, bank_blocks, crcs, read)
        if region is not None:
            regions.append(region)
    if covered != t.shape[0]:
        raise CheckpointError(f"FTW bank {bank} covers {covered} expert rows, the model has {t.shape[0]}")
    return regions


def _float_piece(piece: dict, what: str, t: torch.Tensor, lo: int, part: tuple[int, int], crcs: dict,
                 read: bool) -> _Region | None:
    """A piece of a float bank, of which the pool holds rows ``part`` of the whole model's bank (all
    of it, or, across a pipeline stage's boundary, a part); None when not ``read``."""
    f0, f1 = piece["rows"]
    row_shape = list(t.shape[1:])
    if list(piece["shape"]) != [f1 - f0, *row_shape]:
        raise CheckpointError(f"FTW tensor '{what}' has shape {piece['shape']}, expected {[f1 - f0, *row_shape]}")
    if not read:
        return None
    region = _region(piece, (f1 - f0) * t[0].nbytes, what, crcs)
    a, b = part
    if (a, b) == (f0, f1):
        region.segments = [bytes_of(t[f0 - lo : f1 - lo])]
    else:  # a piece across a stage boundary: read whole, keep this stage's rows
        region.decode = _rows_copier(t, a - lo, b - lo, a - f0, f1 - f0)
    return region


def _block_piece(piece: dict, what: str, bank: str, t: torch.Tensor, lo: int, cfg,
                 bank_blocks: dict[int, ExpertBlocks], crcs: dict, read: bool) -> _Region | None:
    """A piece of a bank in blocks (within one MoE layer's rows): its rows' blocks kept at the start
    of their bank rows, or decoded into a float pool; None when not ``read``."""
    i, h, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    every = _all_moe_layers(cfg)
    f0, f1 = piece["rows"]
    r0, r1 = f0 - lo, f1 - lo  # the piece's rows in this pool
    rank = f0 // e
    if not (0 <= rank < len(every) and f0 < f1 <= (rank + 1) * e):
        raise CheckpointError(f"FTW '{what}' does not lie within one MoE layer's rows")
    blocks = bank_blocks[every[rank]]
    used = blocks.gate_up_row_bytes if bank == "gate_up" else blocks.down_row_bytes
    if list(piece["shape"]) != [r1 - r0, used]:
        raise CheckpointError(f"FTW tensor '{what}' has shape {piece['shape']}, expected {[r1 - r0, used]}")
    if not read:
        return None
    region = _region(piece, (r1 - r0) * used, what, crcs)
    if t.dtype == torch.uint8:  # kept: each row's blocks at the start of its bank row
        region.segments = row_segments(t, r0, r1, used)
    elif blocks.bias:
        raise CheckpointError(f"FTW '{what}': experts with biases in blocks are read as stored only (float32 "
                              "compute, in-process CPU experts); convert the original checkpoint instead")
    elif bank == "gate_up":
        region.decode = _decoder(t[r0:r1], blocks.gate_up, (r1 - r0) * 2 * i, h)
    else:
        region.decode = _decoder(t[r0:r1], blocks.down, (r1 - r0) * h, i)
    return region


def _rows_copier(dst: torch.Tensor, d0: int, d1: int, s0: int, rows: int) -> Callable[[torch.Tensor], None]:
    """Copy rows [s0, s0 + d1 - d0) of a temporary holding ``rows`` rows of ``dst``'s kind into
    ``dst[d0:d1]``."""
    return lambda raw: dst[d0:d1].copy_(raw.view(dst.dtype).view(rows, *dst.shape[1:])[s0 : s0 + d1 - d0])


def cut(segments: list[memoryview], lengths: list[int]) -> list[list[memoryview]]:
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
    pieces = cut(segments, [length for _, length, _ in region.extents])
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
    path = Path(path)
    index = read_index(path)
    stored = getattr(torch, index["dtype"])
    if dtype not in (None, "auto") and parse_dtype({}, dtype) != stored:
        raise ConfigError(f"{path} stores {index['dtype']} weights; convert it again with --dtype to use {dtype}")
    _, cfg = load_hf_config(path, stored)  # the source's config.json, kept beside the shards
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
    _read_regions(index, files, regions, verify, threads, show_progress)
    model.eval()
    return LoadedModel(config=cfg, model=model, pool=pool, model_dir=path)


def _read_regions(index: dict, files: list[Path], regions: list[_Region], verify: bool, threads: int | None,
                  show_progress: bool) -> None:
    """Read every region from the shards ``files`` with parallel positional reads, each extent's
    CRC-32 checked where ``verify``."""
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
                    read_all(ex, _reads(r, [bytes_of(raw)]))
                    r.decode(raw)
    finally:
        bar.close()
        for fd in fds:
            os.close(fd)
