"""Model and data paths: which strings are local paths, which are hub ids, and their absolute form.

Rules (docs/config.md, "Model and data paths"):

- a string that exists on disk (after ``~`` expansion) is a local path;
- one that does not exist but *looks local* is a missing local path, refused at start-up (exit 2)
  naming the flag: it starts with ``.``, ``/``, ``~`` or ``\\``, has more than one ``/`` (a hub id
  is ``name`` or ``org/name``), or its first component names a folder that exists here
  (``runs/rm`` when ``runs/`` exists);
- anything else is a hub id (``gpt2``, ``Qwen/Qwen3-0.6B``);
- the RL driver makes every path that exists locally absolute right after parsing
  (:func:`absolute_local_paths`), so Ray workers and engines started elsewhere find the same folder.

Only ``os.path`` here: no network, no model code.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

#: dotted config keys holding model folders / hub ids (comma-separated lists allowed: reward models)
MODEL_PATH_KEYS = ("model.model_name_or_path", "actor.model_name_or_path", "critic.model_name_or_path",
                   "ref.model_name_or_path", "reward.model_name_or_path", "teacher.model_name_or_path")
#: dotted keys holding dataset specs (comma-separated entries, each ``PATH``, ``PATH@split``, ``builtin:NAME`` or a hub id)
DATA_PATH_KEYS = ("data.dataset", "data.prompt_dataset", "eval.dataset")
#: dotted keys that may name one local file (or hold something else: Jinja text, a URL, ``registry``)
FILE_PATH_KEYS = ("data.tokenizer_chat_template", "train.agent_func_path", "reward.remote_url")
#: dotted keys of folders a run writes (made absolute whether or not they exist yet: Ray workers write them)
OUTPUT_PATH_KEYS = ("ckpt.output_dir", "ckpt.path")


def _expand(path: str) -> str:
    return os.path.expanduser(path)


def exists_locally(path: str) -> bool:
    return bool(path) and os.path.exists(_expand(path))


def first_component(path: str) -> str:
    return path.replace("\\", "/").split("/", 1)[0]


def looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a local path (see the module's rules); says nothing of existence."""
    if path.startswith((".", "/", "~", "\\")) or path.replace("\\", "/").count("/") > 1:
        return True
    head = first_component(path)
    return head != path.replace("\\", "/") and os.path.isdir(head)


def missing_local_path(path: str) -> bool:
    """A path that looks local and does not exist (refused at start-up rather than asked of the hub)."""
    return not exists_locally(path) and looks_local(path)


def is_hub_id(path: str) -> bool:
    """Neither on disk nor local-looking: ``from_pretrained`` would ask the hub for it."""
    return bool(path) and not exists_locally(path) and not looks_local(path)


def local_hint(path: str) -> str:
    """Why an ``org/name``-shaped path was taken as local (its first folder exists here), or ""."""
    head = first_component(path)
    if path.startswith((".", "/", "~", "\\")) or path.replace("\\", "/").count("/") != 1 or not os.path.isdir(head):
        return ""
    return f" (a local path, not a hub id: the folder {head}/ exists here)"


def missing_path_message(path: str, flag: str | None = None, what: str = "model folder") -> str:
    """One line naming the flag and the path (and why it was not taken for a hub id)."""
    return f"{flag + ': ' if flag else ''}{what} not found: {path}{local_hint(path)}"


def split_list(spec: str | None) -> list[str]:
    """Comma-separated entries, stripped, empty ones dropped."""
    return [p.strip() for p in (spec or "").split(",") if p.strip()]


def absolute(path: str) -> str:
    """``path`` made absolute (``~`` expanded, symlinks kept) if it exists locally, else unchanged."""
    return os.path.abspath(_expand(path)) if exists_locally(path) else path


def absolute_model_spec(spec: str) -> str:
    """Each comma-separated model path that exists locally made absolute (hub ids unchanged)."""
    if "," not in spec:
        return absolute(spec)
    return ",".join(absolute(p) for p in split_list(spec))


def absolute_data_entry(entry: str) -> str:
    """One dataset entry: ``PATH`` or ``PATH@split`` with an existing PATH made absolute."""
    if entry.startswith("builtin:"):
        return entry
    if exists_locally(entry) or "@" not in entry:
        return absolute(entry)
    path, _, split = entry.rpartition("@")
    return f"{absolute(path)}@{split}" if exists_locally(path) else entry


def absolute_data_spec(spec: str) -> str:
    entries = split_list(spec)
    new = [absolute_data_entry(e) for e in entries]
    return spec if new == entries else ",".join(new)


def absolute_file(value: str) -> str:
    """An existing local file made absolute; ``endpoints:FILE`` keeps its prefix; other values unchanged."""
    if value.startswith("endpoints:"):
        return "endpoints:" + absolute(value.split(":", 1)[1])
    return absolute(value) if os.path.isfile(_expand(value)) else value


def absolute_value(key: str, value: Any) -> Any:
    """``value`` of dotted config ``key`` with its local paths made absolute (non-path keys unchanged)."""
    if not isinstance(value, str) or not value:
        return value
    if key in MODEL_PATH_KEYS:
        return absolute_model_spec(value)
    if key in DATA_PATH_KEYS:
        return absolute_data_spec(value)
    if key in FILE_PATH_KEYS:
        return absolute_file(value)
    if key in OUTPUT_PATH_KEYS:
        return os.path.abspath(_expand(value))
    return value


def _get(cfg: Any, key: str) -> tuple[bool, Any]:
    node = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def _replace(cfg: Any, key: str, value: Any) -> Any:
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _replace(getattr(cfg, head), rest, value)})


def absolute_local_paths(cfg: Any) -> Any:
    """A copy of config ``cfg`` whose model, data and file paths that exist locally are absolute, and so are
    its output and checkpoint folders (where the Ray workers write the checkpoints and the final model).

    Called by the RL driver right after parsing: Ray workers and engine actors may run in another
    working directory (a cluster started elsewhere) and would take ``runs/sft`` for a hub id."""
    for key in (*MODEL_PATH_KEYS, *DATA_PATH_KEYS, *FILE_PATH_KEYS, *OUTPUT_PATH_KEYS):
        found, value = _get(cfg, key)
        if found:
            new = absolute_value(key, value)
            if new != value:
                cfg = _replace(cfg, key, new)
    return cfg


def model_paths(cfg: Any) -> Iterator[tuple[str, str]]:
    """``(flag, path)`` for every model path set in ``cfg`` (one pair per comma-separated entry)."""
    for key in MODEL_PATH_KEYS:
        found, value = _get(cfg, key)
        if found and isinstance(value, str):
            for path in split_list(value):
                yield f"--{key}", path
