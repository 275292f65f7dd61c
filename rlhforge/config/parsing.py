"""Command line + YAML -> one frozen config dataclass.

Order of precedence: dataclass defaults < ``--config file.yaml`` < command-line flags. Flags and
``--help`` are derived from the dataclasses by tyro. Before tyro sees the command line, OpenRLHF's
flat flag names are rewritten to our dotted ones (``--adam.lr`` -> ``--optim.adam.lr``; the
pre-0.10 flat names such as ``--pretrain`` with a one-line deprecation notice).
"""

from __future__ import annotations

import contextlib

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from rlhforge.config.aliases import CURRENT_FLAT_ALIASES, LEGACY_ALIASES, LEGACY_SWITCHES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

T = TypeVar("T")


class ConfigError(ValueError):
    """An invalid configuration: the message says which field and why."""


def rewrite_aliases(
    argv: Sequence[str],
    current: dict[str, str] | None = None,
    legacy: dict[str, str] | None = None,
    warn=lambda msg: print(msg, file=sys.stderr),
) -> list[str]:
    """Map OpenRLHF flag names onto ours. ``--flag=value`` and ``--flag value`` both work."""
    current = CURRENT_FLAT_ALIASES if current is None else current
    legacy = LEGACY_ALIASES if legacy is None else legacy
    out: list[str] = []
    for token in argv:
        name, eq, value = token.partition("=")
        if not name.startswith("--"):
            out.append(token)
            continue
        if name in current:
            out.append(current[name] + eq + value)
        elif name in LEGACY_SWITCHES and LEGACY_SWITCHES[name]:
            warn(f"[rlhforge] {name} is deprecated; use {' '.join(LEGACY_SWITCHES[name])}")
            out.extend(LEGACY_SWITCHES[name])
        elif name in legacy:
            warn(f"[rlhforge] {name} is deprecated; use {legacy[name]}")
            out.append(legacy[name] + eq + value)
        else:
            out.append(token)
    return out


def _pop_config_path(argv: list[str]) -> str | None:
    for i, token in enumerate(argv):
        if token == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path to a YAML file")
            path = argv[i + 1]
            del argv[i : i + 2]
            return path
        if token.startswith("--config="):
            del argv[i]
            return token.split("=", 1)[1]
    return None


def _unwrap_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _nest_dotted(data: dict[str, Any]) -> dict[str, Any]:
    """``{"train.seed": 1}`` -> ``{"train": {"seed": 1}}`` (nested and dotted keys may mix)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"key {key!r} conflicts with a scalar value")
        leaf = parts[-1]
        if isinstance(value, dict):
            value = _nest_dotted(value)
            if isinstance(node.get(leaf), dict):
                node[leaf].update(value)
                continue
        node[leaf] = value
    return out


def _choices(values) -> str:
    return ", ".join(str(v) for v in values)


def _coerce(tp: Any, value: Any, where: str, key: str) -> Any:
    """``value`` (from YAML) as the field type ``tp``: Literal choices, tuple lengths, int / float /
    bool / str, Optional. Anything else is a :class:`ConfigError` naming the file and the dotted key."""

    def fail(problem: str):
        raise ConfigError(f"{where}: {key}: {problem}")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], value, where, key)
        return value  # pragma: no cover - no such field today
    if value is None:
        fail(f"null is not allowed here (expected {_type_name(tp)})")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) or value not in choices:
            hint = " (YAML reads on/off/yes/no unquoted as true/false: quote the value)" if isinstance(value, bool) else ""
            fail(f"{value!r} is not a valid choice; valid: {_choices(choices)}{hint}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        variable = len(args) == 2 and args[1] is Ellipsis
        if variable:
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            if not items:
                fail(f"expected one or more {_type_name(args[0])} values, got an empty list")
            return tuple(_coerce(args[0], v, where, f"{key}[{i}]") for i, v in enumerate(items))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            fail(f"expected a list of {len(args)} values ({', '.join(_type_name(a) for a in args)}), got {value!r}")
        return tuple(_coerce(a, v, where, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is bool:
        if not isinstance(value, bool):
            fail(f"expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            fail(f"expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        fail(f"expected a number, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            fail(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                fail(f"expected an integer, got {value!r}")
        if isinstance(number, float) and number.is_integer():
            return int(number)
        fail(f"expected an integer, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            fail(f"expected a string, got {value!r} (quote it in the YAML file)")
        return value
    return value  # pragma: no cover - no other field type today


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + _choices(typing.get_args(tp))
    return {bool: "true/false", float: "a number", int: "an integer", str: "a string"}.get(tp, str(tp))


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config", prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (possibly dotted) mapping. Unknown keys and values that do not
    fit the field's type (a Literal's choices, a tuple's length, int/float/bool/str, null only where
    Optional) are ConfigErrors naming ``where`` (the file) and the dotted key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the top level'}: expected a mapping, "
                          f"got {type(data).__name__}")
    data = _nest_dotted(data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            section = prefix.rstrip(".") or "the top level"
            raise ConfigError(
                f"{where}: unknown key {key!r} in {section} ({cls.__name__}); valid keys: {', '.join(sorted(fields))}"
            )
        tp = _unwrap_optional(hints[key])
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value or {}, where, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(hints[key], value, where, f"{prefix}{key}")
    return cls(**kwargs)


def load_yaml(cls: type[T], path: str | Path) -> T:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML: {err}") from err
    return from_dict(cls, data, where=str(path))


def secret(default: Any = None, redacted: Any = None) -> Any:
    """A dataclass field holding a secret (an API key): hidden from ``repr`` and written by
    :func:`to_dict` / :func:`save_yaml` as ``redacted`` (default null), so it never reaches the
    run directory's config.yaml, metrics or experiment trackers."""
    return dataclasses.field(default=default, repr=False, metadata={"secret": True, "redacted": redacted})


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain (YAML-ready) dict of a config; secret fields (:func:`secret`) are redacted."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out = {}
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if f.metadata.get("secret") and v is not None:
                    v = f.metadata.get("redacted")
                out[f.name] = plain(v)
            return out
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(cfg)


def save_yaml(cfg: Any, path: str | Path) -> None:
    """Write the resolved config (atomically) so the run can be reproduced with ``--config``.
    Secrets (API keys) are not written: pass them again by flag or environment variable."""
    path = Path(path)
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException as err:  # no half-written config.yaml.tmp left behind; config.yaml stays as it was
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError):
            raise RunFileWriteError(err.errno, f"could not write {path} (through {tmp}): {err.strerror or err}; "
                                    f"{path} was left as it was") from err
        raise


class RunFileWriteError(OSError):
    """A run-directory file (the resolved ``config.yaml``) could not be written: no space, permission,
    file too large. The CLI ends with one line naming the path and the cause (exit 6, as a failed
    checkpoint write)."""

    def __str__(self) -> str:
        return str(self.strerror)


def parse_args(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
    legacy: dict[str, str] | None = None,
) -> T:
    """Parse ``argv`` into ``cls``: defaults < ``--config`` YAML < flags; then ``cfg.validate()``."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    argv = rewrite_aliases(argv, legacy=legacy)
    config_path = _pop_config_path(argv)
    default = load_yaml(cls, config_path) if config_path else cls()
    cfg = tyro.cli(cls, args=argv, default=default, prog=prog, description=description, use_underscores=True)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg
