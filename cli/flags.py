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


_SETTINGS_MAX_BYTES = 1 << 20  # a settings file is a page of flags; anything larger is a mistake


def expand_settings_file(argv: list[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """``hearth serve|up --config FILE.toml ...``: the file's settings as flags, put before the
    command line's own (so that a flag given there wins; repeated flags such as ``--model`` add up).
    Keys are the flags without ``--`` (``expert-cache`` or ``expert_cache``); ``true`` is a bare
    flag, ``false`` leaves it out, a list repeats it (for repeatable flags only). With ``parser``
    (the command line's), every key and value is checked against the flag it stands for: a
    :class:`ConfigError` names the file, the key and what it expects."""
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
    settings = read_settings_file(path)
    actions = _command_actions(parser, argv[0]) if parser is not None else None
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + _PLURALS.get(key, key).replace("_", "-")
        if actions is not None:
            _check_setting(path, key, value, actions.get(flag))
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, dict):
                raise ConfigError(f"{path}: '{key}' holds a table; settings are flat (key = value)")
            if v is True:
                flags.append(flag)
            elif v is not False:
                flags += [flag, str(v)]
    return [argv[0], *flags, *rest]


def read_settings_file(path: str) -> dict[str, Any]:
    """The TOML table of a settings file; a :class:`ConfigError` (never a traceback) for any bytes."""
    # deferred: tomllib is in the standard library from Python 3.11; on 3.10 only --config needs it
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = f.read(_SETTINGS_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the settings file {path}: {exc.strerror or exc}") from None
    if len(raw) > _SETTINGS_MAX_BYTES:
        raise ConfigError(f"the settings file {path} is larger than {_SETTINGS_MAX_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the settings file {path} is not UTF-8 text (byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the settings file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"the settings file {path} nests arrays or tables too deeply") from None


def _command_actions(parser: argparse.ArgumentParser, command: str) -> dict[str, argparse.Action]:
    """Each ``--flag`` of ``command``'s subparser, with its action."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {opt: action for action in sub._actions for opt in action.option_strings if opt.startswith("--")}


def _check_setting(path: str, key: str, value: Any, action: argparse.Action | None) -> None:
    """A ConfigError unless ``value`` (from TOML) is what the flag for ``key`` takes."""
    where = f"{path}: '{key}'"
    if action is None or action.dest == "config":
        raise ConfigError(f"{where} is not a setting of this command (see its --help for the flags)")
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} expects true or false, got {value!r}")
        return
    repeatable = isinstance(action, argparse._AppendAction)
    if isinstance(value, list) and not repeatable:
        raise ConfigError(f"{where} takes one value, not a list")
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{where} expects {_expected(action)}, got {v!r}")
        try:
            parsed = action.type(str(v)) if callable(action.type) else str(v)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"{where} expects {_expected(action)}, got {v!r}") from None
        if action.choices is not None and parsed not in action.choices:
            raise ConfigError(f"{where} expects one of {', '.join(map(str, action.choices))}, got {v!r}")


def _expected(action: argparse.Action) -> str:
    kind = {int: "an integer", float: "a number"}.get(action.type, "a string")
    return kind + (" (or a list of them)" if isinstance(action, argparse._AppendAction) else "")
