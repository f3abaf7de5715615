"""Command-line flags generated from the configuration tree (:mod:`hearth.config`).

Each setting declared with ``option(...)`` becomes one flag: ``--`` + its option name with dashes
(or the flag it names), its default and help from the declaration, choices from its ``Literal``
type, ``--x/--no-x`` for booleans, a repeatable flag for tuples. Defaults are written once, in the
config; the parsed namespace is turned back into the config by :func:`engine_config` and
:func:`serving_config`, which validate it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from hearth.config import ConfigError, EngineConfig, ServingConfig, is_loopback, leaves, option_name, type_parts

_GROUPS = {"": "engine", "scheduler": "scheduler", "kv_cache": "KV cache", "checkpoints": "state checkpoints",
           "experts": "expert hierarchy"}


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + option_name(f).replace("_", "-")


def _add(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: Any, overrides_only: bool) -> None:
    meta = f.metadata
    choices, kinds, _ = type_parts(hint)
    kwargs: dict[str, Any] = {"dest": option_name(f)}
    if bool in kinds:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif tuple in kinds:
        kwargs.update(action="append", metavar=meta.get("metavar"))
    elif choices or meta.get("choices"):
        kwargs["choices"] = meta.get("choices") or [c for c in choices if c is not None]
    else:
        # Strings that the config parses (sizes such as 2GiB) stay strings here; it checks them.
        number = next((k for k in kinds if k in (int, float)), None)
        kwargs.update(type=str if meta.get("parse") or number is None else number, metavar=meta.get("metavar"))
    default = None if tuple in kinds else f.default
    kwargs["default"] = argparse.SUPPRESS if overrides_only else default
    shown = not overrides_only and default is not None and default is not False
    group.add_argument(_flag(f), help=f"{meta['help']} (default {_show(default)})" if shown else meta["help"],
                       **kwargs)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 30}GiB" if value % (1 << 30) == 0 else f"{value >> 20}MiB"
    return str(value)


def add_engine_flags(parser: argparse.ArgumentParser, overrides_only: bool = False,
                     skip: frozenset[str] = frozenset()) -> None:
    """A flag for every command-line setting of :class:`EngineConfig`, grouped by section.

    ``overrides_only``: flags the user does not give stay out of the namespace (``hearth up``, where
    the placement chooses the rest per machine)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for path, f, hint in leaves(EngineConfig):
        if not f.metadata.get("cli", True) or option_name(f) in skip:
            continue
        key = ".".join(path)
        if key not in groups:
            title = _GROUPS.get(key, key) + (" (overrides; default: chosen per machine)" if overrides_only else "")
            groups[key] = parser.add_argument_group(title)
        _add(groups[key], f, hint, overrides_only)
    groups["experts"].add_argument("--virtual-device", dest="expert_device", action="store_const", const="virtual",
                                   default=argparse.SUPPRESS,
                                   help="shorthand for --expert-device virtual (the cache on a CPU arena standing "
                                        "in for a GPU, on a machine without one)")


def add_serving_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """A flag for every setting of :class:`ServingConfig`."""
    group = parser.add_argument_group("server")
    hints = {f.name: hint for _, f, hint in leaves(ServingConfig)}
    for f in dataclasses.fields(ServingConfig):
        if f.metadata.get("cli", True) and option_name(f) not in skip:
            _add(group, f, hints[f.name], False)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings present in ``args``, by option name."""
    names = {option_name(f) for _, f, _ in leaves(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_config(args: argparse.Namespace, **extra: Any) -> EngineConfig:
    """The validated :class:`EngineConfig` of the parsed flags (plus ``extra`` settings)."""
    return EngineConfig(**engine_options(args), **extra)


def serving_config(args: argparse.Namespace, **extra: Any) -> ServingConfig:
    """The validated :class:`ServingConfig` of the parsed flags (plus ``extra`` settings); the key
    defaults to ``$HEARTH_API_KEY``. Warns when it listens beyond this machine without one (only
    possible with ``--insecure-no-auth``)."""
    names = {option_name(f) for f in dataclasses.fields(ServingConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    serving = ServingConfig.from_options(**{"api_key": os.environ.get("HEARTH_API_KEY") or None, **given, **extra})
    if not is_loopback(serving.host) and not serving.api_keys():
        print(f"hearth: warning: --insecure-no-auth: anyone who can reach {serving.host} may use this server",
              file=sys.stderr)
    return serving


SETTINGS_COMMANDS = ("serve", "up")  # the commands that take ``--config FILE.toml``
_PLURALS = {"models": "model"}  # a list under a plural key is the repeated flag


def expand_settings_file(argv: list[str]) -> list[str]:
    """``hearth serve|up --config FILE.toml ...``: the file's settings as flags, put before the
    command line's own (so that a flag given there wins; repeated flags such as ``--model`` add up).
    Keys are the flags without ``--`` (``expert-cache`` or ``expert_cache``); ``true`` is a bare
    flag, ``false`` leaves it out, a list repeats it."""
    # deferred: tomllib is in the standard library from Python 3.11; on 3.10 only --config needs it
    import tomllib

    if not argv or argv[0] not in SETTINGS_COMMANDS:
        return argv
    rest, path = [], None
    it = iter(argv[1:])
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise ConfigError("--config needs a file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if path is None:
        return argv
    try:
        settings = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the settings file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the settings file {path} is not valid TOML: {exc}") from None
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + _PLURALS.get(key, key).replace("_", "-")
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, dict):
                raise ConfigError(f"{path}: '{key}' holds a table; settings are flat (key = value)")
            if v is True:
                flags.append(flag)
            elif v is not False:
                flags += [flag, str(v)]
    return [argv[0], *flags, *rest]
