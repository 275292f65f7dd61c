"""``Records``: the loaded dataset, a list of plain dicts that keeps every value as the file holds it.

:func:`rlhforge.data.loading.load_dataset_spec` returns one. Unlike a ``datasets.Dataset`` there is
no column typing: a column may hold a string in one record and a number in the next, and each
record keeps exactly its own values (``"0.50"`` stays the string ``"0.50"``, ``7`` stays ``7``,
``null`` stays ``None``; a key a record does not have stays absent). The few ``datasets.Dataset``
methods the trainers and tests use are provided: ``len``, iteration, ``ds[i]``, ``ds[a:b]``,
``ds["column"]`` (``None`` where a record lacks the key), :meth:`select`, :meth:`to_list`,
:attr:`column_names`.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

__all__ = ["Records"]


class Records(Sequence):
    """An ordered list of records (dicts); see the module docstring."""

    __slots__ = ("_rows",)

    def __init__(self, rows: Iterable[dict[str, Any]] = ()):
        self._rows: list[dict[str, Any]] = list(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self._rows)

    def __getitem__(self, key):
        if isinstance(key, str):
            return [row.get(key) for row in self._rows]
        if isinstance(key, slice):
            return Records(self._rows[key])
        return self._rows[key]

    def __eq__(self, other) -> bool:
        if isinstance(other, Records):
            return self._rows == other._rows
        return NotImplemented

    def __repr__(self) -> str:
        return f"Records({len(self._rows)} records, columns {self.column_names})"

    @property
    def column_names(self) -> list[str]:
        """Every key of every record, in first-seen order."""
        seen: dict[str, None] = {}
        for row in self._rows:
            for key in row:
                seen.setdefault(key, None)
        return list(seen)

    def select(self, indices: Iterable[int]) -> "Records":
        """The records at ``indices``, in that order (repeats allowed)."""
        return Records(self._rows[i] for i in indices)

    def to_list(self) -> list[dict[str, Any]]:
        """Shallow copies of the records."""
        return [dict(row) for row in self._rows]

    @staticmethod
    def concatenate(parts: Sequence["Records"]) -> "Records":
        return Records(row for part in parts for row in part)
