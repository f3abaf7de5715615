"""Build the expert backend an engine runs with, from its settings and what the machine has."""

from __future__ import annotations

import logging
from functools import partial

import torch

from hearth.config import ConfigError, ExpertConfig, parse_cache_size
from hearth.engine.config import ModelConfig
from hearth.engine.experts.backend import HierarchicalExpertBackend
from hearth.engine.experts.contract import CpuWorkers, ExpertDevice
from hearth.engine.experts.measure import measure_host_path, measure_link_path, measure_pair_costs
from hearth.engine.experts.mechanism.cpu_workers import CpuExpertWorkers
from hearth.engine.experts.mechanism.device import CudaDevice, VirtualDevice
from hearth.engine.experts.mechanism.ring import ExternalCpuWorkers, ProcessCpuWorkers, RingLayout
from hearth.engine.experts.mechanism.streamer import LayerStreamer
from hearth.engine.experts.policy.cache import ExpertCacheTables
from hearth.engine.experts.policy.qstar import PathCost, SplitCosts, build_qtable, forced_qtable
from hearth.engine.experts.policy.streaming import stream_min_tokens
from hearth.engine.experts.policy.tuning import TUNER_EPOCH_TOKENS, CreditTuner
from hearth.engine.experts.policy.vram import default_cache_bytes
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.ops import activation

log = logging.getLogger(__name__)


def cache_slots(spec: str | None, pool: ExpertPool, default_bytes: int) -> int:
    """Number of cache slots for an ``expert_cache`` setting (see :func:`hearth.config.parse_cache_size`)."""
    total = pool.gate_up.shape[0]
    if spec is None:
        return min(total, default_bytes // pool.expert_bytes)
    kind, amount = parse_cache_size(spec)
    if kind == "slots":
        return min(int(amount), total)
    if kind == "bytes":
        return min(total, int(amount) // pool.expert_bytes)
    return int(amount * total + 1e-9)


def resolve_device(name: str) -> str:
    """The device an (already validated) ``expert_device`` setting means on this machine."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "none"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--expert-device cuda: no CUDA device is available (use --virtual-device on this machine)")
    return name


def build_device(kind: str, pool: ExpertPool, slots: int, virtual_link_gbps: float | None = None,
                 gpu: torch.device | str = "cuda") -> ExpertDevice:
    """A ``cuda`` (on ``gpu``) or ``virtual`` device with ``slots`` expert slots."""
    if kind == "cuda":
        return CudaDevice(pool, slots, gpu)
    return VirtualDevice(pool, slots, virtual_link_gbps * 1e9 if virtual_link_gbps else None)


def build_cpu_workers(cfg: ModelConfig, pool: ExpertPool, hc: ExpertConfig, max_tokens: int, act,
                      pool_name: str | None) -> CpuWorkers:
    """The CPU expert workers ``hc.cpu_workers`` asks for."""
    cores = list(hc.cpu_cores) if hc.cpu_cores else None
    if hc.cpu_workers in ("inline", "thread"):
        return CpuExpertWorkers(pool, act, cores, threaded=hc.cpu_workers == "thread")
    if pool_name is None:
        raise ConfigError("CPU expert workers in another process need the expert pool in shared memory "
                          "(give it a name: host_pool_name / --host-pool)")
    layout = RingLayout(slots=2, max_tokens=max_tokens, hidden=cfg.hidden_size, top_k=cfg.top_k,
                        hidden_act=cfg.hidden_act)
    if hc.cpu_workers == "external":  # a worker that someone else starts attaches to the ring by name
        return ExternalCpuWorkers(pool_name, layout, pool.expert_bytes)
    return ProcessCpuWorkers(pool_name, layout, pool.expert_bytes, cores)


def build_hierarchy(cfg: ModelConfig, pool: ExpertPool, hc: ExpertConfig, max_tokens: int,
                    pool_name: str | None = None, executor_device: torch.device | None = None,
                    in_use: int = 0, link_path: str = "copy") -> HierarchicalExpertBackend | None:
    """The hierarchical backend, or None when there is no device (every expert runs from the pool).
    ``max_tokens`` is the most tokens one step computes; ``pool_name`` names the shared-memory pool
    when there is one (for worker processes); a CUDA cache goes on ``executor_device`` when that is
    a GPU (``--device cuda:N``), else on the current one; ``in_use``: the bytes the executor
    already holds there (dense weights, KV cache), which ``--vram-limit`` counts; ``link_path``: how
    the decode steps fill slots, which B_P is measured through (``measure.LINK_PATHS``: "fill_op"
    for captured steps)."""
    kind = resolve_device(hc.device)
    if kind == "none":
        return None
    if pool.blocks is not None and hc.cpu_workers in ("process", "external"):
        raise ConfigError("experts kept in quantized blocks run on in-process CPU workers only "
                          "(--cpu-experts inline or thread) for now")
    act = activation(cfg.hidden_act)
    gpu = executor_device if executor_device is not None and executor_device.type == "cuda" else torch.device("cuda")
    free = torch.cuda.mem_get_info(gpu)[0] if kind == "cuda" else 0
    default_bytes = default_cache_bytes(kind, free, pool.nbytes, hc.vram_limit, in_use)
    slots = cache_slots(hc.cache, pool, default_bytes)
    device = build_device(kind, pool, slots, hc.virtual_link_gbps, gpu)
    workers = build_cpu_workers(cfg, pool, hc, max_tokens, act, pool_name)
    m_max = cfg.num_experts
    costs, tuner = None, None
    if hc.q_mode in ("table", "step"):
        costs = measure_costs(pool, act, device, cfg.top_k, hc.bandwidths, link_path)
        qtable = build_qtable(costs, m_max)
        log.info("expert cache: %d slots; B_P %.1f GB/s, B_H %.1f GB/s; qtable %s", slots,
                 costs.link.bytes_per_s / 1e9, costs.host_bytes_per_s / 1e9, qtable.tolist())
        if hc.q_mode == "table":
            tuner = CreditTuner(epoch_calls=TUNER_EPOCH_TOKENS * len(pool.moe_layer_ids))
    else:
        qtable = forced_qtable(hc.q_mode, m_max)
    tables = ExpertCacheTables(pool.num_global_ids, slots, qtable, max_fills=m_max, device=device.device)
    backend = HierarchicalExpertBackend(pool, act, device, tables, workers, costs, tuner)
    backend.link_path = link_path  # the idle probes (probe) measure the same path
    backend.stream_setup = partial(_attach_streamer, cfg=cfg, pool=pool, hc=hc, max_tokens=max_tokens)
    backend.stream_setup(backend, slots)
    return backend


def _attach_streamer(backend: HierarchicalExpertBackend, slots: int, *, cfg: ModelConfig, pool: ExpertPool,
                     hc: ExpertConfig, max_tokens: int) -> None:
    """Prefill streaming when ``slots`` hold its buffers, with its step-size threshold (given, or
    from the measured costs and again whenever the monitor changes them); none otherwise. Called
    again when the cache is resized."""
    buffers = 2 if hc.double_buffer else 1
    costs = backend.costs
    backend.stream_threshold = None
    # Where every expert can stay resident, buffers would only evict (unless streaming is asked for).
    holds_all = slots >= pool.gate_up.shape[0] and hc.stream_min_tokens is None
    if holds_all or not LayerStreamer.fits(pool, slots, buffers) or (costs is None and hc.stream_min_tokens is None):
        backend.streamer = None  # every step takes the decode path
        return
    if backend.streamer is None:
        backend.streamer = LayerStreamer(pool, backend.device, backend.tables, buffers, backend.prefill_stats)
        backend.prefill_stats = backend.streamer.stats
    if hc.stream_min_tokens is None:
        resident = max(slots - buffers * pool.num_experts, 0) / pool.num_global_ids
        backend.stream_threshold = partial(stream_min_tokens, num_experts=cfg.num_experts, top_k=cfg.top_k,
                                           resident=resident, max_tokens=max_tokens)
    min_tokens = hc.stream_min_tokens if hc.stream_min_tokens is not None else backend.stream_threshold(costs)
    backend.stream_min_tokens = min_tokens
    log.info("prefill streaming: %d buffer(s), steps of >= %d tokens", buffers, min_tokens)


def measure_costs(pool: ExpertPool, act, device, k: int, bandwidths: tuple[float, float] | None,
                  link_path: str = "copy") -> SplitCosts:
    """Costs of both paths: given bandwidths, or a quick measurement of the real paths (the link
    through ``link_path``: see :func:`build_hierarchy`)."""
    cpu_pair, device_pair = 0.0, 0.0  # only prefill streaming's threshold reads them
    if LayerStreamer.fits(pool, device.num_slots, buffers=1):
        cpu_pair, device_pair = measure_pair_costs(pool, act, device)  # scribbles on slot 0 (tables still empty)
    if bandwidths is not None:
        return SplitCosts(pool.expert_bytes, PathCost(bandwidths[0]), bandwidths[1], cpu_pair_s=cpu_pair,
                          device_pair_s=device_pair)
    host = measure_host_path(pool, act, k, repeats=15)
    if device.num_slots == 0:
        link = PathCost(max(device.link_bytes_per_s or host.bytes_per_s, 1.0))
    else:
        # Scribbles on slots the (still empty) tables do not use.
        link = measure_link_path(device, pool, k, repeats=15, path=link_path)
    return SplitCosts(pool.expert_bytes, link, host.bytes_per_s, cpu_fixed_s=host.fixed_s, cpu_pair_s=cpu_pair,
                      device_pair_s=device_pair)

