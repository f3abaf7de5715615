"""A random model with a real model's exact shapes, built in seconds, for GPU decode benchmarks.

``build_shape_model(root)`` makes something ``hearth.engine.LLM`` loads through the real loading
code (``load_checkpoint`` -> ``load_ftw``, the shared-memory host pool), at Qwen3-30B-A3B's shapes by
default (48 layers, hidden 2048, 128 experts top-8, bf16: ~3.1 GB dense, ~54 GiB experts). Building
it with transformers (fp32 init, ``save_pretrained``) and converting would take far longer; here:

* **An FTW directory** (engine/checkpoint/ftw.py) at ``root``: ``config.json`` (the checkpoint's, as
  ``hearth convert`` copies it), ``ftw.json`` and two shards. FTW, not safetensors, because only an
  FTW checkpoint can take its experts from an already filled shared pool (``load_checkpoint``
  refuses ``filled_pool`` for anything else). No tokenizer: the engine loads without one
  (``load_tokenizer`` returns None) and prompts are then token ids.
* **Dense weights** (embeddings, attention, norms, routers, lm_head) in shard 0 as random bf16
  (normal * 0.02; norm weights 1.0, other vectors 0.0), named and shaped by the engine's own model
  (built with untouched ``torch.empty`` weights), so the tensor table is what ``load_ftw`` checks. Their
  values are rotations of one random block (a different rotation per 64 MiB extent), written with
  ``pwritev`` straight from that block with each extent's real CRC-32: no per-tensor random
  generation, and the directory passes ``verify_checksums``.
* **Expert banks**: the FTW index must still list every bank piece (``load_ftw`` checks their rows
  and shapes, and ``_check_shards`` the shard's size) but does not read them when a filled pool is
  given. So shard 1 is a *sparse* file (``truncate``: no disk space, no writes) whose index
  extents carry the CRC-32 of zero bytes: the directory stays a valid FTW on its own (loaded
  without the pool, every expert is zero; a copy with ``cp`` may materialise the holes).
  The real experts live in a named shared-memory pool (``HostExpertPool.create`` with
  ``ExpertPool.bank_shapes(cfg)``, the model dtype: what ``load_ftw``/``ExpertPool`` expect), filled
  with random bf16 and marked filled. An engine given ``host_pool_name=<pool name>`` attaches to it
  (``LLMEngine._attach_filled_pool``) read-only and reads no expert byte from disk.
  Fill on ``device="cpu"``: rotated copies of one random block, in parallel threads (numpy copies
  release the GIL); the cost is the kernel's first touch of the tmpfs pages. On ``device="cuda"``:
  ``torch.randn`` on the GPU per 64 MiB chunk, copied to the host chunk by chunk (independent
  values; one pageable copy at a time, so not expected to beat the CPU fill on a 16-core host).

Cleanup: ``ShapeModel.close()`` (or leaving ``with build_shape_model(...) as m:``) unlinks the
pool; the owner's finalizer also unlinks it when the process exits normally or on an unhandled
exception. A SIGKILLed (or SIGTERMed, which skips Python's exit handlers) benchmark leaves the
segment behind: call :func:`remove_stale_pools` at start (it removes shape-model pools whose owner
is gone), or ``hearth pool clean NAME``. A full-shape pool needs ~54 GiB in ``/dev/shm``; the build
refuses up front when there is not that much free (tmpfs would SIGBUS mid-fill instead).

Known limit (engine, not this module; not yet tried on a GPU): an engine that *attaches* to a pool
maps it read-only (``HostExpertPool.attach``), and the CUDA expert cache pins it with
``cudaHostRegister(..., cudaHostRegisterMapped)``. CUDA's documentation says that without
``cudaDevAttrPageableMemoryAccessUsesHostPageTables`` (x86 hosts) a read-only mapping needs the
``cudaHostRegisterReadOnly`` flag too, so ``LLM(..., device="cuda", host_pool_name=...)`` may fail
there until the engine passes that flag or its executor attaches writable. The fallback:
``build_shape_model(root, with_pool=False)``, load with ``verify_checksums=False`` (the engine reads
the sparse banks as zeros into its own pool: ~54 GiB of holes read, slower than attaching), then
:func:`fill_banks` on ``engine.pool.gate_up`` / ``engine.pool.down`` (same seed and device: same
experts).

Greedy decoding of random weights soon repeats one token, and with it one set of experts per layer
(a warm expert cache then always hits): sample (``temperature=1.0`` with a ``seed``) where the
routing should vary from token to token.

:func:`decode_bytes` estimates the bytes of the dense and expert weights and what one decode token
reads at batch 1 (the HBM / host-bandwidth bound of a decode benchmark).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from hearth.engine.checkpoint.dispatch import load_config
from hearth.engine.checkpoint.ftw import ALIGN, EXTENT, FORMAT, INDEX, VERSION
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.mechanism.host_pool import HostExpertPool, cleanup, list_pools
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.models import build_model

# Qwen3-30B-A3B's config.json (Hugging Face), immutable; ``shape`` arguments override its keys.
QWEN3_30B_A3B: Mapping[str, Any] = MappingProxyType({
    "architectures": ("Qwen3MoeForCausalLM",), "model_type": "qwen3_moe",
    "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "intermediate_size": 6144, "vocab_size": 151936, "max_position_embeddings": 40960,
    "decoder_sparse_step": 1, "mlp_only_layers": (), "norm_topk_prob": True, "attention_bias": False,
    "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 48,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "initializer_range": 0.02,
})
POOL_PREFIX = "hearth-shape-"  # every pool this module names starts so (remove_stale_pools finds them)
SCALE = 0.02  # the random weights' standard deviation (Qwen's initializer_range)
_DENSE_SHARD, _BANK_SHARD = "weights-00000.ftw", "weights-00001.ftw"
_BANKS = ("gate_up", "down")
_MIN_BLOCK = 64 << 10
_IOV_BATCH = 512  # segments per pwritev call (below every system's IOV_MAX)


def full_config(shape: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Qwen3-30B-A3B's config.json with ``shape``'s keys overriding it (JSON-ready: lists, not
    tuples). An EOS id outside a smaller vocabulary is moved to its last token."""
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in {**QWEN3_30B_A3B, **(shape or {})}.items()}
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(cfg.get(key), int) and cfg[key] >= cfg["vocab_size"]:
            cfg[key] = cfg["vocab_size"] - 1
    return cfg


# -- the bytes a decode step reads ------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeBytes:
    """Weight bytes of a qwen3_moe-shaped model and what one decode token reads at batch 1."""

    dense_bytes: int  # every non-expert weight (embeddings, attention, norms, routers, lm_head)
    expert_bytes: int  # every expert of every MoE layer
    dense_bytes_per_token: int  # the dense weights one token reads (one embedding row, all the rest)
    expert_bytes_per_token: int  # top_k experts in every MoE layer
    kv_bytes_per_context_token: int  # KV cache bytes each token of context adds to a step's reads

    @property
    def bytes_per_token(self) -> int:
        """Weight bytes one decode token reads at batch 1 (no KV cache)."""
        return self.dense_bytes_per_token + self.expert_bytes_per_token

    def step_bytes(self, context_tokens: int = 0) -> int:
        """Bytes one batch-1 decode step reads with ``context_tokens`` of KV cache."""
        return self.bytes_per_token + context_tokens * self.kv_bytes_per_context_token


def decode_bytes(shape: Mapping[str, Any] | None = None) -> DecodeBytes:
    """The byte counts of :class:`DecodeBytes` for ``shape`` (Qwen3-30B-A3B by default; keys as in
    :func:`full_config`), by the qwen3_moe family's layout: q/k/v/o projections with per-head q/k
    norms, two norms per layer, a router [E, H] per MoE layer, a gated MLP on ``mlp_only_layers``."""
    c = full_config(shape)
    elem = torch.empty((), dtype=getattr(torch, c["torch_dtype"])).element_size()
    h, v, e = c["hidden_size"], c["vocab_size"], c["num_experts"]
    q, kv, head = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"], c["head_dim"]
    attention = 2 * q * h + 2 * kv * h + 2 * head + (q + 2 * kv + h if c["attention_bias"] else 0)
    moe = _moe_flags(c)
    per_layer = [attention + 2 * h + (e * h if is_moe else 3 * h * c["intermediate_size"]) for is_moe in moe]
    embed = v * h
    dense = sum(per_layer) + h + embed * (1 if c["tie_word_embeddings"] else 2)
    expert = 3 * h * c["moe_intermediate_size"]
    # A token reads one embedding row; a tied lm_head reads the whole table anyway.
    dense_read = dense if c["tie_word_embeddings"] else dense - embed + h
    return DecodeBytes(dense_bytes=dense * elem, expert_bytes=sum(moe) * e * expert * elem,
                       dense_bytes_per_token=dense_read * elem,
                       expert_bytes_per_token=sum(moe) * c["num_experts_per_tok"] * expert * elem,
                       kv_bytes_per_context_token=len(moe) * 2 * kv * elem)


def _moe_flags(c: Mapping[str, Any]) -> list[bool]:
    """Which layers are MoE (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step`` rule)."""
    step, dense = max(int(c.get("decoder_sparse_step") or 1), 1), set(c.get("mlp_only_layers") or ())
    return [i not in dense and (i + 1) % step == 0 for i in range(c["num_hidden_layers"])]


# -- random bytes ------------------------------------------------------------------------------------


class _Tiles:
    """One block of random values (normal * SCALE); any run of bytes is a rotation of it, starting
    at an offset derived from a key (deterministic for a seed, whatever the thread order)."""

    def __init__(self, dtype: torch.dtype, seed: int, nbytes: int) -> None:
        elem = torch.empty((), dtype=dtype).element_size()
        n = max(_MIN_BLOCK, min(EXTENT, nbytes)) // elem
        values = torch.empty(n, dtype=dtype).normal_(0.0, SCALE, generator=torch.Generator().manual_seed(seed))
        self.block = values.view(torch.uint8).numpy()
        self.seed = seed

    def spans(self, key: str, nbytes: int) -> Iterator[tuple[int, int]]:
        """(start, end) byte ranges of the block that, in order, make ``nbytes`` random bytes."""
        size = len(self.block)
        digest = hashlib.blake2b(f"{self.seed}/{key}".encode(), digest_size=8).digest()
        pos = int.from_bytes(digest, "little") % size // 64 * 64  # cache-line aligned: fast copies
        while nbytes:
            take = min(size - pos, nbytes)
            yield pos, pos + take
            nbytes -= take
            pos = 0

    def views(self, key: str, nbytes: int) -> list[memoryview]:
        block = memoryview(self.block)
        return [block[a:b] for a, b in self.spans(key, nbytes)]


@cache
def _zero_crc(nbytes: int) -> int:
    """CRC-32 of ``nbytes`` zero bytes (the sparse bank shard's extents: a few distinct lengths)."""
    return zlib.crc32(bytes(nbytes))


def _extents(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """The extents the FTW reader checks: cut every EXTENT bytes from the tensor's own offset."""
    return [(offset + s, min(EXTENT, nbytes - s)) for s in range(0, nbytes, EXTENT)]


def _workers(threads: int | None) -> int:
    return threads or os.cpu_count() or 1


# -- the FTW directory -------------------------------------------------------------------------------


@dataclass
class _Tensor:
    """One dense parameter to write: its name, shape, dtype, fill and place in the dense shard."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float | None  # a constant (norms 1.0, other vectors 0.0), or None for random values
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _dense_tensors(cfg) -> list[_Tensor]:
    """The parameters ``load_ftw`` expects, from the engine's own model, with aligned offsets in the
    dense shard. Its weights are ``torch.empty`` (pages never touched) and its expert banks are
    zero-storage expansions of the right shapes (the meta device would do too, but its first use
    imports seconds of torch's decompositions)."""
    banks = tuple(torch.empty((), dtype=cfg.dtype).expand(s) for s in ExpertPool.bank_shapes(cfg))
    model = build_model(cfg, LocalExpertBackend(ExpertPool(cfg, banks), cfg.hidden_act))
    tensors, offset = [], 0
    for name, p in model.named_parameters():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # stored once, as the embedding (as write_ftw does)
        fill = (1.0 if "norm" in name else 0.0) if p.dim() == 1 else None
        offset = -(-offset // ALIGN) * ALIGN
        tensors.append(_Tensor(name, tuple(p.shape), p.dtype, fill, offset))
        offset += tensors[-1].nbytes
    return tensors


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` in order at ``offset`` (positional: threads share one descriptor)."""
    for i in range(0, len(views), _IOV_BATCH):
        batch = views[i : i + _IOV_BATCH]
        want = sum(len(v) for v in batch)
        done = os.pwritev(fd, batch, offset)
        if done != want:  # regular files write all or fail; finish a short write plainly
            os.pwrite(fd, b"".join(bytes(v) for v in batch)[done:], offset + done)
        offset += want


def _write_extent(fd: int, t: _Tensor, start: int, length: int, tiles: dict[torch.dtype, _Tiles]) -> list[int]:
    """Write one extent of ``t`` (random or constant) at ``start``; returns [start, length, crc]."""
    if t.fill is None:
        views = tiles[t.dtype].views(f"{t.name}/{start - t.offset}", length)
    else:
        const = torch.full((length // torch.empty((), dtype=t.dtype).element_size(),), t.fill, dtype=t.dtype)
        views = [memoryview(const.view(torch.uint8).numpy())]
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    _pwrite_all(fd, views, start)
    return [start, length, crc]


def _write_dense(path: Path, tensors: list[_Tensor], seed: int, threads: int | None) -> dict:
    """Shard 0: every dense tensor, extents written in parallel; returns the shard's index entry."""
    randoms = [t for t in tensors if t.fill is None]
    tiles = {dt: _Tiles(dt, seed, sum(t.nbytes for t in randoms if t.dtype == dt))
             for dt in {t.dtype for t in randoms}}
    size = max((t.offset + t.nbytes for t in tensors), default=0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        with ThreadPoolExecutor(_workers(threads)) as ex:
            futures = [ex.submit(_write_extent, fd, t, start, length, tiles)
                       for t in tensors for start, length in _extents(t.offset, t.nbytes)]
            extents = [f.result() for f in futures]
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return {"file": path.name, "bytes": size, "checksum": "crc32-per-extent", "extents": sorted(extents)}


def _write_banks(path: Path, cfg) -> tuple[dict[str, list[dict]], dict]:
    """Shard 1: every bank piece (one per MoE layer and bank) as a hole of zeros; returns the bank
    pieces and the shard's index entry."""
    shapes, e = ExpertPool.bank_shapes(cfg), cfg.num_experts
    elem = torch.empty((), dtype=cfg.dtype).element_size()
    pieces: dict[str, list[dict]] = {bank: [] for bank in _BANKS}
    extents, offset = [], 0
    for bank, shape in zip(_BANKS, shapes, strict=True):
        nbytes = e * math.prod(shape[1:]) * elem
        for rank in range(len(cfg.moe_layer_ids)):
            offset = -(-offset // ALIGN) * ALIGN
            pieces[bank].append({"shard": 1, "offset": offset, "shape": [e, *shape[1:]],
                                 "rows": [rank * e, (rank + 1) * e]})
            extents += [[start, length, _zero_crc(length)] for start, length in _extents(offset, nbytes)]
            offset += nbytes
    with open(path, "wb") as f:
        f.truncate(offset)  # sparse: no disk space, nothing written
    return pieces, {"file": path.name, "bytes": offset, "checksum": "crc32-per-extent", "extents": extents}


def _write_ftw(root: Path, config: dict, seed: int, threads: int | None) -> tuple[Any, int]:
    """The whole FTW directory; returns (the engine's ModelConfig, dense bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / INDEX).unlink(missing_ok=True)  # a half-written directory is never mistaken for a whole one
    (root / "config.json").write_text(json.dumps(config, indent=2))
    _, cfg = load_config(root)  # the engine's own reading of it (family, dtype, MoE layers)
    tensors = _dense_tensors(cfg)
    dense_shard = _write_dense(root / _DENSE_SHARD, tensors, seed, threads)
    pieces, bank_shard = _write_banks(root / _BANK_SHARD, cfg)
    index = {
        "format": FORMAT, "version": VERSION, "alignment": ALIGN, "extent_bytes": EXTENT,
        "dtype": str(cfg.dtype).removeprefix("torch."), "config": config,
        "banks": {"order": "global id (layer * num_experts + expert), MoE layers only",
                  "moe_layers": list(cfg.moe_layer_ids), "num_experts": cfg.num_experts, **pieces},
        "tensors": {t.name: {"shard": 0, "offset": t.offset, "shape": list(t.shape),
                             "dtype": str(t.dtype).removeprefix("torch.")} for t in tensors},
        "shards": [dense_shard, bank_shard],
    }
    (root / INDEX).write_text(json.dumps(index))
    return cfg, sum(t.nbytes for t in tensors)


# -- the expert pool ---------------------------------------------------------------------------------


def fill_banks(gate_up: torch.Tensor, down: torch.Tensor, seed: int = 0, device: str = "cpu",
               threads: int | None = None) -> None:
    """Fill two expert banks (host tensors, e.g. a shared pool's or an engine's ``pool``) with random
    values of scale SCALE, 64 MiB at a time: rotations of one random block on the CPU, or fresh
    ``torch.randn`` chunks generated on ``device`` (a GPU) and copied to the host."""
    if torch.device(device).type != "cpu":
        _fill_from_device(gate_up, down, seed, torch.device(device))
        return
    tiles = _Tiles(gate_up.dtype, seed + 1, gate_up.nbytes + down.nbytes)
    jobs = []
    for bank, t in zip(_BANKS, (gate_up, down), strict=True):
        flat = t.reshape(-1).view(torch.uint8).numpy()  # the bank's own pages (no copy)
        jobs += [(bank, flat, start) for start in range(0, len(flat), EXTENT)]

    def copy(bank: str, flat: np.ndarray, start: int) -> None:
        pos = start
        for a, b in tiles.spans(f"{bank}/{start}", min(EXTENT, len(flat) - start)):
            np.copyto(flat[pos : pos + b - a], tiles.block[a:b])  # releases the GIL: threads run in parallel
            pos += b - a

    with ThreadPoolExecutor(_workers(threads)) as ex:
        for f in [ex.submit(copy, *job) for job in jobs]:
            f.result()


def _fill_from_device(gate_up: torch.Tensor, down: torch.Tensor, seed: int, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    for t in (gate_up, down):
        flat = t.reshape(-1)
        step = EXTENT // t.element_size()
        for start in range(0, flat.numel(), step):
            part = flat[start : start + step]
            chunk = torch.randn(part.numel(), dtype=t.dtype, device=device, generator=generator)
            part.copy_(chunk.mul_(SCALE))  # device -> pageable host memory: synchronous, one chunk at a time


def _check_shm_space(nbytes: int) -> None:
    """Refuse a pool that /dev/shm cannot hold: tmpfs would kill the filling process with SIGBUS."""
    root = Path("/dev/shm")
    if not root.is_dir():
        return
    free = shutil.disk_usage(root).free
    if free < nbytes:
        raise RuntimeError(f"the expert pool needs {nbytes / 2**30:.1f} GiB in /dev/shm, {free / 2**30:.1f} GiB is "
                           "free (remove_stale_pools() / `hearth pool clean NAME` frees old pools; a container "
                           "may need a larger --shm-size)")


def _make_pool(cfg, name: str, seed: int, device: str, threads: int | None) -> HostExpertPool:
    """Create, fill and mark filled a shared pool with the banks ``load_ftw`` expects for ``cfg``."""
    shapes = ExpertPool.bank_shapes(cfg)
    _check_shm_space(sum(math.prod(s) for s in shapes) * torch.empty((), dtype=cfg.dtype).element_size())
    pool = HostExpertPool.create(name, *shapes, cfg.dtype)
    try:
        fill_banks(pool.gate_up, pool.down, seed, device, threads)
        pool.mark_filled()
    except BaseException:
        pool.close()  # unlinks: never leave a half-filled pool behind
        raise
    return pool


# -- the public entry ---------------------------------------------------------------------------------


@dataclass
class ShapeModel:
    """A built shape model: pass ``path`` and :meth:`engine_options` to ``LLM``; close to unlink the pool."""

    path: Path  # the FTW directory
    pool_name: str | None  # the filled shared pool (None: built with_pool=False)
    shape: Mapping[str, Any]  # the config.json it was built from
    dense_bytes: int
    expert_bytes: int
    seconds: Mapping[str, float]  # "dense" (FTW directory), "experts" (pool fill), "total"
    host_pool: HostExpertPool | None = field(default=None, repr=False)

    def engine_options(self) -> dict[str, Any]:
        """The ``LLM`` / ``EngineConfig`` options that attach an engine to the filled pool."""
        return {"host_pool_name": self.pool_name} if self.pool_name else {}

    def close(self) -> None:
        """Unlink the shared pool (engines attached to it keep their mapping until they close)."""
        if self.host_pool is not None:
            self.host_pool.close()  # the owner's close removes the name
            self.host_pool = None

    def __enter__(self) -> ShapeModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_shape_model(root: str | Path, shape: Mapping[str, Any] | None = None, pool_name: str | None = None,
                      seed: int = 0, device: str = "cpu", threads: int | None = None,
                      with_pool: bool = True) -> ShapeModel:
    """Write a random qwen3_moe FTW directory at ``root`` with Qwen3-30B-A3B's shapes (``shape``:
    config.json keys overriding them) and, ``with_pool``, a filled shared expert pool named
    ``pool_name`` (default: a fresh ``hearth-shape-…`` name). ``device`` generates the experts
    (``"cpu"`` or a GPU); ``threads`` bounds the writers and fillers (default: every CPU)."""
    start = time.perf_counter()
    config = full_config(shape)
    cfg, dense = _write_ftw(Path(root), config, seed, threads)
    written = time.perf_counter()
    pool = None
    if with_pool:
        name = pool_name or f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        pool = _make_pool(cfg, name, seed, device, threads)
    done = time.perf_counter()
    expert = sum(math.prod(s) for s in ExpertPool.bank_shapes(cfg)) * torch.empty((), dtype=cfg.dtype).element_size()
    return ShapeModel(Path(root), pool.name if pool else None, MappingProxyType(config), dense, expert,
                      MappingProxyType({"dense": written - start, "experts": done - written, "total": done - start}),
                      pool)


def remove_stale_pools(prefix: str = POOL_PREFIX) -> list[str]:
    """Unlink the shared pools named ``prefix…`` whose owner process is gone (a killed benchmark's);
    returns their names."""
    stale = [p["name"] for p in list_pools() if p["name"].startswith(prefix) and not p["owner_alive"]]
    return [name for name in stale if cleanup(name)]
