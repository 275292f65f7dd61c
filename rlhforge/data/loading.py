"""Load datasets from a comma-separated spec and mix them.

``load_dataset_spec("a.jsonl,b.parquet", probs="0.7,0.3")`` returns one
:class:`~rlhforge.data.recordset.Records` (a list of plain dicts).

Values are read exactly as written: JSON Lines and JSON files are parsed record by record with
Python's ``json`` module and CSV files with the ``csv`` module (:mod:`rlhforge.data.readers`), so a
column may mix strings and numbers and nothing is re-typed (``"0.50"`` stays the string
``"0.50"``, ``7`` stays ``7``, ``"true"`` stays ``"true"``, ``null`` is ``None``; every CSV value is
the string in the cell). Parquet, Arrow and ``datasets`` folders keep their own schema's values
(read with ``datasets``, then turned into dicts). A byte that is not UTF-8 is a ``DataError``
naming the file, line and byte offset.

Entries of ``spec`` (comma-separated; entries themselves cannot contain commas):

- a local file: ``.jsonl``, ``.json`` (a list of records, or JSON lines), ``.csv``, ``.parquet``,
  ``.arrow`` (Arrow IPC stream or file);
- a folder written by ``datasets.save_to_disk`` (``load_from_disk``; a ``DatasetDict`` gives the
  requested split);
- a folder of data files of the formats above (searched recursively; if some file names carry
  the split name - ``train.jsonl``, ``test-0001.parquet``, ``train/part.csv`` - only that split's
  files are read, otherwise all of them);
- ``builtin:NAME`` (see :mod:`rlhforge.data.builtin`);
- anything else is taken as a Hugging Face Hub id (``datasets.load_dataset(id, split=...)``; needs
  network access).

Any entry may end in ``@split`` (``path@test``, ``builtin:arithmetic@test``); without it the
``split`` argument applies. A single data file has only one split: ``@train`` is accepted,
another explicit split is an error. If the whole entry (with its ``@``) exists as a path, it is
taken as that path.

Provenance: every record gets two extra keys, ``_source`` (the file path as written in the
spec, ``path/inside/folder.jsonl`` for folders of files, ``builtin:NAME@split``, or the hub id
with its split) and ``_index`` (0-based record index within that source), and records of
JSON Lines, JSON and CSV files a third, ``_line`` (the 1-based line where the record starts).
They survive mixing and truncation, so later stages can say "data/train.jsonl, record 17, field
'output': ... [line 18]" (:class:`rlhforge.data.errors.DataError`). Existing keys with these names
are replaced.

Mixing: without ``probs`` the datasets are concatenated in spec order (a key one record lacks stays
absent in that record). With ``probs`` they are interleaved the way
``datasets.interleave_datasets(..., probabilities, seed, stopping_strategy="all_exhausted")``
does it (same order for the same seed): each record is drawn from dataset *i* with probability
``p_i`` (a seeded ``numpy`` generator) until every dataset has been used up at least once; smaller
datasets are cycled (oversampled) meanwhile. Datasets with probability 0 are left out. The order
is otherwise kept: the trainer shuffles. ``max_samples`` then keeps the first ``max_samples``
records.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlhforge.data.errors import DataError
from rlhforge.data.recordset import Records

if TYPE_CHECKING:  # pragma: no cover
    import datasets

__all__ = ["load_dataset_spec", "load_train_and_eval", "parse_probs", "SUPPORTED_EXTENSIONS", "SOURCE_COLUMN",
           "INDEX_COLUMN", "LINE_COLUMN", "Records"]

logger = logging.getLogger(__name__)

SOURCE_COLUMN = "_source"
INDEX_COLUMN = "_index"
LINE_COLUMN = "_line"
_PROVENANCE = (SOURCE_COLUMN, INDEX_COLUMN, LINE_COLUMN)

#: file extension -> reader (``json``/``csv``: rlhforge.data.readers; ``parquet``/``arrow``: ``datasets``)
SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}

#: extensions that mark an entry as a (missing or unsupported) local file rather than a hub id
_OTHER_FILE_EXTENSIONS = {
    ".txt", ".tsv", ".xlsx", ".xls", ".gz", ".zip", ".bz2", ".xz", ".zst", ".pkl", ".pt", ".npy", ".yaml", ".yml",
}
_SAVE_TO_DISK_MARKERS = ("dataset_dict.json", "state.json")
_PROB_TOLERANCE = 1e-6


# --------------------------------------------------------------------------------------------
# public entry point


def load_dataset_spec(
    spec: str,
    probs: str | None = None,
    split: str = "train",
    max_samples: int | None = None,
    seed: int = 42,
) -> Records:
    """Load and mix the datasets named in ``spec`` (see the module docstring).

    Args:
        spec: comma-separated entries (files, folders, ``builtin:NAME``, hub ids), each with an
            optional ``@split``.
        probs: comma-separated mixing probabilities, one per entry, each >= 0, summing to 1
            (within 1e-6). ``None`` concatenates.
        split: split for entries without ``@split`` (``datasets`` folders, folders of files,
            built-ins, hub ids).
        max_samples: keep at most this many records after mixing (``None``: all).
        seed: seed of the mixture sampler.

    Returns:
        :class:`Records`: every record as a dict with its values as read, plus ``_source``,
        ``_index`` (and ``_line`` for line-based files).

    Raises:
        DataError: missing or empty file, malformed JSON line or CSV row (file and line number), a
            byte that is not UTF-8 (file, line, byte offset), unknown extension, unknown split, bad
            ``probs``.
    """
    entries = [e.strip() for e in (spec or "").split(",")]
    if not spec or not any(entries):
        raise DataError("no dataset given (empty dataset spec)")
    if any(not e for e in entries):
        raise DataError(f"dataset spec {spec!r} has an empty entry (check for stray commas)")
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max_samples must be >= 1 (got {max_samples})")

    probabilities = parse_probs(probs, entries) if probs is not None else None
    parts = [ds for _, ds in (_load_entry(entry, split) for entry in entries)]

    if probabilities is not None and len(parts) > 1:
        keep = [i for i, p in enumerate(probabilities) if p > 0]
        if len(keep) == 1:
            dataset = parts[keep[0]]
        else:
            dataset = _interleave([parts[i] for i in keep], [probabilities[i] for i in keep], seed)
    elif len(parts) > 1:
        dataset = Records.concatenate(parts)
    else:
        dataset = parts[0]

    if max_samples is not None and len(dataset) > max_samples:
        dataset = dataset.select(range(max_samples))
    return dataset


def _interleave(parts: list[Records], probabilities: list[float], seed: int) -> Records:
    """``datasets.interleave_datasets(parts, probabilities, seed, stopping_strategy="all_exhausted")``
    on plain records: the same seeded draws (numpy ``default_rng(seed).choice`` in blocks of 1000),
    so the same order; stops once every part has been drawn ``len(part)`` times, cycling the others."""
    import numpy as np

    lengths = [len(p) for p in parts]
    rng = np.random.default_rng(seed)
    current, exhausted = [0] * len(parts), [False] * len(parts)
    rows: list[dict] = []
    while not all(exhausted):
        for src in rng.choice(len(parts), size=1000, p=probabilities):
            if all(exhausted):
                break
            src = int(src)
            rows.append(parts[src][current[src]])
            current[src] += 1
            if current[src] >= lengths[src]:
                exhausted[src], current[src] = True, 0
    return Records(rows)


def load_train_and_eval(data_cfg, eval_cfg, seed: int):
    """Training records from ``--data.*`` and eval records from ``--eval.dataset``, or the last
    ``--eval.holdout_ratio`` of the training records (None when neither is set)."""
    train = load_dataset_spec(data_cfg.dataset, data_cfg.dataset_probs, data_cfg.dataset_split,
                              data_cfg.max_samples, seed=seed)
    if eval_cfg.dataset:
        return train, load_dataset_spec(eval_cfg.dataset, None, eval_cfg.split, eval_cfg.max_samples, seed=seed)
    if eval_cfg.holdout_ratio > 0:
        n_eval = max(1, int(len(train) * eval_cfg.holdout_ratio))
        return train.select(range(len(train) - n_eval)), train.select(range(len(train) - n_eval, len(train)))
    return train, None


def parse_probs(probs: str, entries: list[str]) -> list[float]:
    """Parse ``"0.7,0.3"``; check count, sign and sum (error messages show the numbers)."""
    raw = [p.strip() for p in str(probs).split(",")]
    try:
        values = [float(p) for p in raw]
    except ValueError:
        raise DataError(f"dataset_probs {probs!r}: every entry must be a number") from None
    if len(values) != len(entries):
        raise DataError(
            f"dataset_probs has {len(values)} value(s) ({probs}) but the dataset spec has {len(entries)} "
            f"entr{'y' if len(entries) == 1 else 'ies'} ({', '.join(entries)})"
        )
    negative = [f"{e}={v}" for e, v in zip(entries, values) if not v >= 0]
    if negative:
        raise DataError(f"dataset_probs must be >= 0; got {', '.join(negative)}")
    total = sum(values)
    if abs(total - 1.0) > _PROB_TOLERANCE:
        raise DataError(
            f"dataset_probs must sum to 1: {' + '.join(raw)} = {total:.6g} "
            f"(off by {total - 1.0:+.3g}; tolerance {_PROB_TOLERANCE:g})"
        )
    return values


# --------------------------------------------------------------------------------------------
# one entry


def _split_entry(entry: str) -> tuple[str, str | None]:
    """``path@split`` -> (path, split); an existing path containing ``@`` is kept whole."""
    if entry.startswith("builtin:") or os.path.exists(os.path.expanduser(entry)) or "@" not in entry:
        return entry, None
    path, _, split = entry.rpartition("@")
    if not path or not split:
        raise DataError(f"cannot parse dataset entry {entry!r}; expected PATH or PATH@SPLIT")
    return path, split


def _load_entry(entry: str, default_split: str) -> tuple[str, Records]:
    if entry.startswith("builtin:"):
        return _load_builtin(entry, default_split)
    path_str, explicit_split = _split_entry(entry)
    split = explicit_split or default_split
    path = Path(os.path.expanduser(path_str))
    if path.is_file():
        if explicit_split not in (None, "train"):
            raise DataError(
                f"{path_str} is a single file, which has one split; '@{explicit_split}' only applies to "
                "datasets folders, folders of data files, built-in datasets and hub ids"
            )
        return path_str, _load_file(path, path_str)
    if path.is_dir():
        return _load_folder(path, path_str, split, explicit_split is not None)
    if _looks_local(path_str):
        ext = _extension(path_str)
        hint = "" if not ext or ext in SUPPORTED_EXTENSIONS else f" (and {_unsupported(ext)})"
        raise DataError(f"dataset file or folder not found: {path_str}{hint}", source=None)
    return _load_hub(path_str, split)


def _extension(path: str) -> str:
    return Path(path).suffix.lower()


def _unsupported(ext: str) -> str:
    return f"extension {ext!r} is not supported; supported: {', '.join(SUPPORTED_EXTENSIONS)}"


def _looks_local(path: str) -> bool:
    """A spec entry that is clearly meant as a local path rather than a hub id (the model paths' rule,
    :func:`rlhforge.config.paths.looks_local`: ``data/x`` when ``data/`` exists here, too; or a data
    file extension)."""
    from rlhforge.config.paths import looks_local

    return (
        looks_local(path)
        or "\\" in path
        or _extension(path) in SUPPORTED_EXTENSIONS
        or _extension(path) in _OTHER_FILE_EXTENSIONS
        or path.count("/") > 1
    )


def _with_provenance(rows, source: str, lines: list[int | None] | None = None) -> Records:
    """Records with ``_source``/``_index`` (and ``_line`` where ``lines`` gives it) set."""
    out = []
    for i, row in enumerate(rows):
        rec = {k: v for k, v in row.items() if k not in _PROVENANCE}
        rec[SOURCE_COLUMN], rec[INDEX_COLUMN] = source, i
        if lines is not None and lines[i] is not None:
            rec[LINE_COLUMN] = lines[i]
        out.append(rec)
    return Records(out)


# --------------------------------------------------------------------------------------------
# files


def _load_file(path: Path, name: str) -> Records:
    """Read one local data file, with provenance (``name`` is its ``_source``)."""
    ext = _extension(str(path))
    if ext not in SUPPORTED_EXTENSIONS:
        raise DataError(_unsupported(ext), source=name)
    if path.stat().st_size == 0 or (ext in (".jsonl", ".json", ".csv") and not _has_text(path)):
        raise DataError("file is empty", source=name)
    builder = SUPPORTED_EXTENSIONS[ext]
    if builder in ("json", "csv"):
        from rlhforge.data.readers import read_csv, read_json, read_jsonl

        reader = read_csv if builder == "csv" else read_json if ext == ".json" else read_jsonl
        try:
            pairs = reader(path, name)
        except OSError as err:
            raise DataError(f"could not read the file: {err}", source=name) from err
        if not pairs:
            raise DataError("file has no records", source=name)
        return _with_provenance([r for _, r in pairs], name, [line for line, _ in pairs])
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - re-raised with the file named
        raise DataError(f"could not read {builder} file: {_short(err)}", source=name) from err
    if len(ds) == 0:
        raise DataError("file has no records", source=name)
    return _with_provenance(ds.to_list(), name)


def _has_text(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _short(err: BaseException) -> str:
    # datasets wraps the real cause; show the innermost message
    while err.__cause__ is not None or err.__context__ is not None:
        nxt = err.__cause__ or err.__context__
        if nxt is None or nxt is err:
            break
        err = nxt
    text = f"{type(err).__name__}: {err}".strip()
    return text if len(text) < 500 else text[:497] + "..."


# --------------------------------------------------------------------------------------------
# folders


def _load_folder(path: Path, name: str, split: str, explicit: bool) -> tuple[str, Records]:
    if any((path / marker).exists() for marker in _SAVE_TO_DISK_MARKERS):
        import datasets

        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:  # noqa: BLE001
            raise DataError(f"could not load datasets folder: {_short(err)}", source=name) from err
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"no split {split!r}; available splits: {', '.join(loaded)}", source=name)
            ds, source = loaded[split], f"{name}@{split}"
        else:
            if explicit and split != "train":
                raise DataError(f"folder holds a single Dataset (no splits); cannot select '@{split}'", source=name)
            ds, source = loaded, name
        if len(ds) == 0:
            raise DataError("dataset is empty", source=source)
        return source, _with_provenance(ds.to_list(), source)

    files = sorted(p for p in path.rglob("*") if p.is_file() and _extension(str(p)) in SUPPORTED_EXTENSIONS)
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(path).parts)]
    if not files:
        raise DataError(
            f"folder has no data files (looked for {', '.join(SUPPORTED_EXTENSIONS)}) and is not a "
            "datasets.save_to_disk folder",
            source=name,
        )
    chosen = [p for p in files if _file_in_split(p.relative_to(path), split)]
    if not chosen:
        if explicit:
            listing = ", ".join(str(p.relative_to(path)) for p in files[:10])
            raise DataError(f"no data files for split {split!r} (files: {listing})", source=name)
        chosen = files
    exts = {_extension(str(p)) for p in chosen}
    if len({SUPPORTED_EXTENSIONS[e] for e in exts}) > 1:
        raise DataError(
            f"folder mixes data formats ({', '.join(sorted(exts))}); use one format per folder", source=name
        )
    parts = []
    for p in chosen:
        source = str(Path(name) / p.relative_to(path))
        parts.append(_load_file(p, source))
    return name, Records.concatenate(parts)


def _file_in_split(rel: Path, split: str) -> bool:
    """``train.jsonl``, ``train-00001.parquet``, ``data_train.csv``, ``train/x.jsonl`` belong to 'train'."""
    if split in rel.parts[:-1]:
        return True
    stem = rel.name.split(".")[0]
    tokens = stem.replace("_", "-").split("-")
    return split in tokens


# --------------------------------------------------------------------------------------------
# built-ins and hub


def _load_builtin(entry: str, default_split: str) -> tuple[str, Records]:
    from rlhforge.data.builtin import generate_builtin, parse_builtin_spec

    spec = parse_builtin_spec(entry)
    split = spec.split or default_split
    params = dict(spec.params)
    n, seed = params.pop("n", None), params.pop("seed", 0)
    records = generate_builtin(spec.name, split=split, n=n, seed=seed, **params)
    query = "&".join(f"{k}={v}" for k, v in sorted(spec.params.items()))
    source = f"builtin:{spec.name}{'?' + query if query else ''}@{split}"
    return source, _with_provenance(records, source)


def _load_hub(name: str, split: str) -> tuple[str, Records]:
    """A hub dataset; when the hub cannot be reached (one short probe, rlhforge.data.hub), only from
    the local cache, so a missing one fails in seconds instead of after the hub client's retries."""
    import contextlib

    import datasets

    from rlhforge.data.hub import hub_endpoint, hub_offline, hub_unreachable, offline_for_datasets

    reason = None if hub_offline() else hub_unreachable()
    try:
        with offline_for_datasets() if reason else contextlib.nullcontext():
            ds = datasets.load_dataset(name, split=split)
    except Exception as err:  # noqa: BLE001
        why = (f"the Hugging Face Hub ({hub_endpoint()}) could not be reached ({reason}); from the local cache: "
               f"{_short(err)}" if reason else f"loading it as a Hugging Face Hub dataset (split {split!r}) failed: "
               f"{_short(err)}")
        raise DataError(f"{name!r} is not a local file or folder, and {why}") from err
    source = f"{name}@{split}"
    if len(ds) == 0:
        raise DataError("dataset is empty", source=source)
    return source, _with_provenance(ds.to_list(), source)
