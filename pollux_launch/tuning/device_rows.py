"""Measurements left on the device until a scheduled point reads them back (issue 31).

A measured step produces a small row of device scalars (squared norms, a dot product...)
and some host values (counts, scales) that say how to fold it into the estimator.
Reading the row at once would make the host wait for the device; :class:`DeviceRows`
keeps the rows where they are, by kind (rows of one kind share a shape), with their host
part in step order, and :meth:`DeviceRows.take` reads them all back - one stack and one
copy per kind - at a scheduled point (``sync_points``), where the owner folds them in.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

ROWS_KEPT = 4096  # rows read back anyway (an owner whose scheduled points never came)


class DeviceRows:
    """Pending rows by kind, with their host part in order (module docstring)."""

    def __init__(self, kinds: Iterable[str], limit: int = ROWS_KEPT) -> None:
        self._rows: dict[str, list[torch.Tensor]] = {kind: [] for kind in kinds}
        self._meta: list[tuple[Any, ...]] = []
        self.limit = limit

    def __len__(self) -> int:
        return len(self._meta)

    def add(self, kind: str, row: torch.Tensor, meta: tuple[Any, ...]) -> bool:
        """Keep ``row`` (no copy, no read) and its host part; True once ``limit`` rows
        wait (the owner should read them back: nothing else bounds them)."""
        self._rows[kind].append(row)
        self._meta.append((kind, *meta))
        return len(self._meta) >= self.limit

    def take(self) -> list[tuple[tuple[Any, ...], list[float]]]:
        """Every pending row as ``((kind, *meta), values)`` in the order added, read back
        with one device->host copy per kind; none pending afterwards. This reads device
        values: call it at a scheduled point."""
        if not self._meta:
            return []
        values = {kind: iter(torch.stack(rows).tolist() if rows else [])
                  for kind, rows in self._rows.items()}
        meta, self._meta = self._meta, []
        self._rows = {kind: [] for kind in self._rows}
        return [(m, next(values[m[0]])) for m in meta]

    def clear(self) -> None:
        """Drop the pending rows (their estimator was replaced)."""
        self._meta = []
        self._rows = {kind: [] for kind in self._rows}
