"""hearth's one configuration tree: frozen, typed, validated when built.

Every setting a user can change is one field of one section, declared with :func:`option`: its
default, its help text and, where it differs from the field's name, its *option name* (the keyword
that ``LLM(path, name=value)`` takes and, with dashes, the ``hearth`` flag). From that one
declaration come the attribute (``config.scheduler.prefill_chunk``), the keyword, the flag with its
default and choices (:mod:`hearth.cli.flags`), and the check that runs when the config is built. The
tree crosses process boundaries as it is (Ray pickles it).

    EngineConfig            what one engine runs with
      .scheduler            SchedulerConfig
      .kv_cache             KVCacheConfig
      .checkpoints          CheckpointConfig  (recurrent-state checkpoints of hybrid models)
      .experts              ExpertConfig      (the expert hierarchy)
    ServingConfig           where and how ``hearth serve`` listens

Sections take their own fields; :class:`EngineConfig` also takes any leaf by option name and puts it
in its section (``EngineConfig(prefix_caching=True)``). No torch here: the contracts and the CLI read
this module without loading the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import re
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

GIB = 1 << 30
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """A setting, or a checkpoint's config.json, is missing, malformed or unsupported."""


def parse_bytes(text: str | int) -> int:
    """``4GiB``, ``512MB``, ``1048576`` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]i?b|b)?", str(text).strip().lower())
    if m is None:
        raise ConfigError(f"cannot read a size from '{text}' (e.g. 4GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def parse_cache_size(spec: str | float) -> tuple[Literal["fraction", "slots", "bytes"], float]:
    """An expert-cache size: a fraction of all experts (``0.1``), slots (``8slots``) or bytes with a
    unit (``2GiB``), as (kind, amount)."""
    text = str(spec).strip().lower().replace(" ", "")
    if (m := re.fullmatch(r"(\d+)slots?", text)) is not None:
        return "slots", int(m.group(1))
    if re.fullmatch(r"\d+(?:\.\d+)?", text) is not None:
        if float(text) > 1:
            raise ConfigError(f"expert_cache '{spec}': a bare number is a fraction of all experts (0..1); "
                              "give bytes with a unit, e.g. 2GiB")
        return "fraction", float(text)
    if re.fullmatch(r"\d+(?:\.\d+)?[kmgt]i?b|\d+b", text) is None:
        raise ConfigError(f"expert_cache: cannot read '{spec}' (use a fraction like 0.1, bytes like 2GiB, or slots "
                          "like 8slots)")
    return "bytes", parse_bytes(text)


def cache_dir() -> Path:
    """hearth's user cache: ``$HEARTH_CACHE``, else ``$XDG_CACHE_HOME/hearth``, else ``~/.cache/hearth``."""
    if os.environ.get("HEARTH_CACHE"):
        return Path(os.environ["HEARTH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hearth"


def option(default: Any, help: str, *, name: str | None = None, flag: str | None = None, cli: bool = True,
           choices: tuple[str, ...] | None = None, metavar: str | None = None, minimum: float | None = None,
           parse: Callable[[str], Any] | None = None) -> Any:
    """Declare one setting (a dataclass field).

    ``name``: the option name when it is not the field's (unique over the whole tree); ``flag``: the
    command-line flag when it is not ``--`` + the name with dashes (booleans get ``--x/--no-x``);
    ``cli=False``: settable from Python only; ``choices``: the flag's choices when they are fewer
    than the type allows; ``minimum``: the least allowed number; ``parse``: how a string from the
    command line (or a keyword) becomes the value, e.g. :func:`parse_bytes`."""
    meta = {"help": help, "name": name, "flag": flag, "cli": cli, "choices": choices, "metavar": metavar,
            "minimum": minimum, "parse": parse}
    return field(default=default, metadata=meta)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def type_parts(hint: Any) -> tuple[tuple[Any, ...] | None, tuple[type, ...], bool]:
    """(literal choices or None, accepted types, None allowed) of a field's annotation."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    optional = type(None) in args
    choices, kinds = None, []
    for arg in args:
        if arg is type(None):
            continue
        if typing.get_origin(arg) is Literal:
            choices = typing.get_args(arg)
        else:
            kinds.append(typing.get_origin(arg) or arg)
    return choices, tuple(kinds), optional


class Section:
    """Base of the config sections: every field is checked against its annotation when built."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, _checked(f, _hints(type(self))[f.name], getattr(self, f.name)))
        self.validate()

    def validate(self) -> None:
        """Checks that involve several fields (sections override it)."""

    @classmethod
    def from_options(cls, **options: Any) -> Section:
        """Build from option names (``served_model_name=...``) rather than field names."""
        names = {option_name(f): f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown} (known: {', '.join(sorted(names))})")
        return cls(**{names[k]: v for k, v in options.items()})


def _checked(f: dataclasses.Field, hint: Any, value: Any) -> Any:
    """``value`` for field ``f``, parsed and coerced to its annotation; a ConfigError when it does not fit."""
    label = option_name(f)
    choices, kinds, optional = type_parts(hint)
    if isinstance(value, Section):
        if not isinstance(value, kinds):
            raise ConfigError(f"{label}: expected a {_describe(None, kinds)}, got {type(value).__name__}")
        return value
    parse = f.metadata.get("parse")
    if parse is not None and isinstance(value, str):
        value = parse(value)
    value = _coerce(value, kinds)
    if value is None:
        if not optional:
            raise ConfigError(f"{label}: a value is required")
        return None
    if choices is not None:
        if value not in choices:
            raise ConfigError(f"{label}: '{value}' is not one of {', '.join(map(repr, choices))}")
        return value
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"{label}: expected {_describe(choices, kinds)}, got {value!r}")
    minimum = f.metadata.get("minimum")
    if minimum is not None and isinstance(value, (int, float)) and value < minimum:
        raise ConfigError(f"{label}: must be at least {minimum:g}, got {value!r}")
    return value


def _coerce(value: Any, kinds: tuple[type, ...]) -> Any:
    """The usual conversions between what Python callers pass and the annotated type."""
    if value is None or isinstance(value, bool):
        return value
    numeric = int in kinds or float in kinds
    if isinstance(value, float) and int in kinds and float not in kinds and value.is_integer():
        return int(value)
    if isinstance(value, int) and float in kinds and int not in kinds:
        return float(value)
    if isinstance(value, (int, float)) and str in kinds and not numeric:
        return str(value)  # expert_cache=0.25
    if isinstance(value, list) and tuple in kinds:
        return tuple(value)
    if isinstance(value, str) and tuple in kinds and str not in kinds:
        return (value,)
    return value


def _describe(choices: tuple | None, kinds: tuple[type, ...]) -> str:
    parts = [", ".join(map(repr, choices))] if choices else []
    parts += [k.__name__ for k in kinds]
    return " or ".join(parts) or "nothing"


def option_name(f: dataclasses.Field) -> str:
    """The keyword (and, with dashes, the flag) of a field."""
    return f.metadata.get("name") or f.name


# -- the sections ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SchedulerConfig(Section):
    """Limits of one engine step (continuous batching)."""

    max_num_seqs: int = option(16, "requests decoded together", minimum=1)
    max_num_batched_tokens: int | None = option(
        None, "tokens one step may compute (default: max(prefill chunk, 2048))", minimum=1, cli=False)
    prefill_chunk: int = option(512, "prompt tokens per prefill chunk", minimum=1)

    @property
    def step_tokens(self) -> int:
        """The step's token budget."""
        return self.max_num_batched_tokens or max(self.prefill_chunk, 2048)


DEFAULT_CONTEXT_CAP = 32768  # without --max-model-len: the model's context, at most this


@dataclass(frozen=True)
class KVCacheConfig(Section):
    """The paged KV cache and the prefix tree over it."""

    block_size: int = option(16, "tokens per KV block", minimum=1, cli=False)
    num_tokens: int | None = option(None, "KV cache size in tokens (default: max_num_seqs full-length "
                                          "sequences within kv_cache_bytes)", name="kv_cache_tokens", minimum=1,
                                    cli=False)
    num_bytes: int = option(2 * GIB, "memory for the KV cache when its size in tokens is not given",
                            name="kv_cache_bytes", parse=parse_bytes, minimum=1, metavar="BYTES")
    prefix_caching: bool = option(True, "reuse the KV blocks of cached prompt prefixes across requests (radix tree)")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Recurrent-state checkpoints of hybrid models (with prefix caching)."""

    policy: Literal["none", "prompt-end", "periodic", "anchors"] = option(
        "anchors", "hybrid models with --prefix-caching: where to keep recurrent-state checkpoints (anchors: "
                   "semantic anchors plus periodic ones)", name="checkpoints")
    interval: int = option(64, "tokens between periodic checkpoints (a multiple of the KV block size)",
                           name="checkpoint_interval", minimum=1, metavar="N")
    budget_bytes: int = option(GIB, "memory for recurrent-state checkpoints", name="checkpoint_bytes",
                               flag="--checkpoint-budget", parse=parse_bytes, minimum=0, metavar="BYTES")


@dataclass(frozen=True)
class ExpertConfig(Section):
    """The expert hierarchy: device cache, split of the misses, CPU expert workers, prefill streaming."""

    device: Literal["auto", "cuda", "virtual", "none"] = option(
        "auto", "where the expert cache lives (auto: CUDA when present, else every expert on the CPU; virtual: a "
                "separate CPU arena standing in for a GPU)", name="expert_device")
    cache: str | None = option(None, "device expert cache: fraction of all experts (0.1), bytes (2GiB) or slots "
                                     "(8slots); default: what the device's free memory allows",
                               name="expert_cache", metavar="SIZE")
    virtual_link_gbps: float | None = option(None, "rate-limit the virtual device's copy path to X GB/s",
                                             minimum=0, metavar="X")
    q_mode: Literal["table", "step", "zero", "all"] = option(
        "table", "split of the misses: the q* table tuned online (default), the untuned per-step table, all on "
                 "the CPU, or fill all (ablations)")
    bandwidths: tuple[float, float] | None = option(None, "(B_P, B_H) in bytes/s to use instead of measuring them",
                                                     name="expert_bandwidths", cli=False)
    double_buffer: bool = option(True, "stream prefill layers through two buffers (--no-double-buffer: one, the "
                                       "ablation without copy overlap)")
    stream_min_tokens: int | None = option(None, "steps of at least N tokens stream whole layers (default: "
                                                 "chosen from measured costs)", minimum=1, metavar="N")
    cpu_workers: Literal["inline", "thread", "process", "external"] = option(
        "inline", "where CPU experts run: the calling thread, a bound worker thread, or a worker process (needs "
                  "--host-pool); external: a worker someone else starts", name="cpu_experts",
        choices=("inline", "thread", "process"))
    cpu_cores: tuple[int, ...] | None = option(None, "CPUs the CPU expert workers bind to (default: one per "
                                                     "physical core)", cli=False)
    host_pool: str | None = option(None, "put the expert pool in the shared-memory segment NAME",
                                   name="host_pool_name", flag="--host-pool", metavar="NAME")
    record_routing: str | None = option(None, "write the routed expert ids of every step and layer (JSON lines)",
                                        metavar="FILE")
    vram_watch: bool = option(True, "elastic VRAM: follow the GPU's free memory (NVML), shrinking the expert cache "
                                    "when other programs need memory and growing it back to its starting size "
                                    "when they free it (--no-vram-watch: resize on request only)")
    vram_limit: int | None = option(None, "the most memory the executor takes on its device, dense weights, KV "
                                          "cache and expert cache together (default: what the GPU has free); to "
                                          "share the GPU, or to stand in for a smaller one", parse=parse_bytes,
                                    minimum=0, metavar="BYTES")
    vram_reserve: int = option(1 << 30, "GPU memory the elastic expert cache leaves free for other programs",
                               parse=parse_bytes, minimum=0, metavar="BYTES")

    def validate(self) -> None:
        if self.cache is not None:
            parse_cache_size(self.cache)  # refused now, not when the engine sizes the cache
        if self.cpu_workers in ("process", "external") and not self.host_pool:
            raise ConfigError("cpu_experts: CPU expert workers in another process need the expert pool in shared "
                              "memory (give it a name: host_pool_name / --host-pool)")
        if self.bandwidths is not None and (len(self.bandwidths) != 2 or min(self.bandwidths) <= 0):
            raise ConfigError(f"expert_bandwidths: give (B_P, B_H) in bytes/s, both positive; got {self.bandwidths}")


@dataclass(frozen=True, init=False)
class EngineConfig(Section):
    """Everything one engine runs with; every field has a sane default for a single machine.

    Takes its sections (``scheduler=SchedulerConfig(...)``) and any leaf by option name
    (``EngineConfig(prefill_chunk=256, expert_device="virtual")``)."""

    dtype: str = option("auto", "compute dtype: auto (the checkpoint's), float32, bfloat16 or float16")
    max_model_len: int | None = option(None, "longest context in tokens (default: the model's, at most 32k)",
                                       minimum=2)
    verify_checksums: bool = option(True, "check every FTW extent's CRC while loading", flag="--verify")
    threads: int | None = option(None, "CPU threads for torch (default: torch's choice)", minimum=1)
    int8_activations: bool = option(False, "quantize activations to int8 for GGML-quantized weights in decode "
                                    "(llama.cpp's scheme: faster, not exact; off by default)")
    device: str = option("auto", "where the dense weights, the KV cache and sampling run: cpu, cuda or cuda:N (the GPU "
                                 "executor); auto: CUDA where it is present", metavar="DEVICE")
    static_decode: Literal["off", "eager", "compile", "graph"] = option(
        "off", "decode steps in fixed-shape buckets (engine/executor/fixed_shape.py): off, eager, compile (the "
               "whole step as one torch.compile graph per bucket), or graph (compiled and captured as a CUDA graph per "
               "bucket; a GPU only)")
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    experts: ExpertConfig = field(default_factory=ExpertConfig)

    def __init__(self, **options: Any) -> None:
        own = {f.name: f for f in dataclasses.fields(self)}
        values = {name: f.default_factory() if _is_section(f) else f.default for name, f in own.items()}
        changes: dict[str, dict[str, Any]] = {}
        index = leaf_index(EngineConfig)
        for key, value in options.items():
            if key in own and (isinstance(value, Section) or not _is_section(own[key])):
                values[key] = value  # a whole section, or a setting of the root
            elif key in index:
                section, attr = index[key]
                changes.setdefault(section, {})[attr] = value
            else:
                raise ConfigError(f"unknown engine option '{key}' (known: {', '.join(sorted(index))})")
        for section, fields_ in changes.items():
            values[section] = dataclasses.replace(values[section], **fields_)
        if values["dtype"] is not None and not isinstance(values["dtype"], str):  # a torch.dtype
            values["dtype"] = str(values["dtype"]).removeprefix("torch.")
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    def validate(self) -> None:
        if self.dtype is None:
            object.__setattr__(self, "dtype", "auto")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype: unsupported '{self.dtype}' (auto, {', '.join(DTYPE_NAMES[1:])})")
        interval, block = self.checkpoints.interval, self.kv_cache.block_size
        if interval % block:
            raise ConfigError(f"checkpoint_interval must be a positive multiple of the block size ({block}), "
                              f"got {interval}")

    def context_length(self, max_position_embeddings: int) -> int:
        """The context served for a model trained to ``max_position_embeddings`` positions."""
        return self.max_model_len or min(max_position_embeddings, DEFAULT_CONTEXT_CAP)

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with some options changed (by option name or section)."""
        return EngineConfig(**{**self.options(), **options})

    def options(self) -> dict[str, Any]:
        """Every leaf by option name (the keywords that rebuild this config)."""
        return {name: getattr(section_of(self, path), attr) for name, (path, attr) in leaf_index(EngineConfig).items()}


@dataclass(frozen=True)
class ServingConfig(Section):
    """Where and how ``hearth serve`` (and the cluster's router) listen."""

    host: str = option("127.0.0.1", "address to listen on (HTTP and gRPC; beyond loopback it needs --api-key)")
    port: int = option(8000, "HTTP port", minimum=0)
    grpc_port: int | None = option(50051, "gRPC port (0 disables gRPC)", minimum=0)
    api_key: str | None = option(None, "require this key (default: $HEARTH_API_KEY, else none)")
    api_key_file: str | None = option(None, "a file of accepted API keys, one per line ('#' starts a comment), "
                                            "besides --api-key", metavar="PATH")
    insecure_no_auth: bool = option(False, "serve a non-loopback --host without an API key (refused otherwise)")
    max_body_bytes: int = option(8 << 20, "largest request body (e.g. 8MiB); larger ones get 413", minimum=1024,
                                 name="max_body_size", parse=parse_bytes)
    intake_timeout: float = option(30.0, "seconds to parse, render and tokenize one request before it gets 503",
                                   minimum=0.1)
    model_names: tuple[str, ...] = option((), "name clients use for the model (repeatable; default: the "
                                              "directory name)", name="served_model_name", metavar="NAME")
    max_waiting: int = option(64, "requests that may wait beyond those running; more get 429/529", name="max_queue",
                              minimum=0)
    max_queued_tokens: int | None = option(None, "prompt tokens that may wait to start; more get 429/529 (default: "
                                                 "no bound beyond --max-queue)", minimum=1)
    max_queue_wait: float = option(60.0, "a request whose estimated wait to start is longer gets 429/529 at once, "
                                         "with Retry-After (0: no bound)", minimum=0)
    tool_parser: Literal["hermes", "qwen3_coder", "glm45", "minimax_m2", "deepseek", "deepseek_v4", "deepseek_v32",
                         "kimi_k2", "harmony", "none"] | None = option(
        None, "tool-call format (default: chosen from the model family and chat template)")
    log_format: Literal["json", "text"] = option("json", "log lines on stderr")
    allowed_hosts: tuple[str, ...] = option((), "a Host name the server answers besides IP addresses, loopback names "
                                                "and (beyond loopback) this machine's names; '.example.com' a domain, "
                                                "'*' any (repeatable; a guard against DNS rebinding)",
                                            name="allowed_host", flag="--allowed-hosts", metavar="NAME")
    cors_origins: tuple[str, ...] = option((), "a web origin whose pages may call the API from a browser, e.g. "
                                               "http://localhost:3000 (repeatable; default none: CORS off)",
                                           name="cors_origin", metavar="ORIGIN")
    response_store_bytes: int = option(64 << 20, "memory for stored /v1/responses results (e.g. 64MiB); the oldest "
                                                 "go first", name="response_store_size", minimum=0, parse=parse_bytes)
    read_timeout: float = option(30.0, "seconds a client may take to send a request's headers, and between the "
                                       "pieces of its body; a slower connection is closed", minimum=0.1)

    def validate(self) -> None:
        if self.grpc_port == 0:
            object.__setattr__(self, "grpc_port", None)
        if not is_loopback(self.host) and not self.api_keys() and not self.insecure_no_auth:
            raise ConfigError(f"refusing to listen on {self.host} (beyond this machine) without an API key: give "
                              "--api-key KEY or HEARTH_API_KEY, or --insecure-no-auth to serve it open")

    def api_keys(self) -> tuple[str, ...]:
        """Every accepted key: ``api_key`` and the lines of ``api_key_file`` (read now)."""
        keys = [self.api_key] if self.api_key else []
        if self.api_key_file:
            try:
                text = Path(self.api_key_file).read_text()
            except OSError as exc:
                raise ConfigError(f"--api-key-file {self.api_key_file}: {exc.strerror or exc}") from None
            found = [line.split("#", 1)[0].strip() for line in text.splitlines()]
            if not any(found):
                raise ConfigError(f"--api-key-file {self.api_key_file}: no keys in it")
            keys += [k for k in found if k]
        return tuple(keys)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


# -- walking the tree ---------------------------------------------------------------------------
def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and isinstance(f.default_factory, type) \
        and issubclass(f.default_factory, Section)


def leaves(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dataclasses.Field, Any]]:
    """(section path, field, annotation) of every setting under ``cls``, in declaration order."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(f):
            yield from leaves(f.default_factory, (*path, f.name))
        else:
            yield path, f, hints[f.name]


@functools.cache
def leaf_index(cls: type) -> dict[str, tuple[str, str]]:
    """Option name -> (section attribute, or '' for the root; field name)."""
    index: dict[str, tuple[str, str]] = {}
    for path, f, _ in leaves(cls):
        name = option_name(f)
        if name in index:
            raise TypeError(f"option name '{name}' is declared twice in {cls.__name__}")
        index[name] = (".".join(path), f.name)
    return index


def section_of(config: Any, path: str) -> Any:
    for part in filter(None, path.split(".")):
        config = getattr(config, part)
    return config
