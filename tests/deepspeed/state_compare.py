"""Comparing consolidated DeepSpeed engine states (shared by the test worker scripts)."""

from __future__ import annotations

import torch

SKIP = ("client", "partitions", "partial")  # not training state, or a newcomer's own view


def close(a, b, path="state") -> list[str]:
    """Differences between two consolidated states (tensors to fp tolerance)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
            return [f"{path}: shape/type differs"]
        ok = torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-7)
        return [] if ok else [f"{path}: max diff {(a.double() - b.double()).abs().max():.3g}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in close(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def as_held_by(state: dict, holder: dict) -> dict:
    """``state`` without its non-training parts, cut down to what ``holder`` has: a ZeRO-1/2
    newcomer's restored state is partial (only its own optimizer partitions); survivors'
    checks cover the whole consolidated state, newcomers' partitions included."""
    out = {k: v for k, v in state.items() if k not in SKIP}
    if holder.get("partial"):
        have = holder["optimizer"]["state"]
        out["master"] = None
        out["optimizer"] = {**out["optimizer"], "state": {
            n: {k: v for k, v in entry.items() if k in have[n]}
            for n, entry in out["optimizer"]["state"].items()}}
    return out
