"""The Pollux trace tables of one model, and the ground truth the simulator reads from them.

``traces/README.md`` states the data semantics; this module follows how the Pollux
authors' simulator used them, so that our figures are comparable to the published ones:

* M0 = smallest validated batch size, max batch size = largest; per-GPU batch bounds
  from ``placements.csv`` (yolov3's largest per-GPU batch is 8).
* Epoch e ends at P(e) = min over validated M of ``progress`` in row e; a job is done
  when its progress (in M0-iterations) reaches P(max_epochs).
* Step/sync time of a *measured* placement is linear in ``local_bsz``; an unmeasured
  one is linearly interpolated over (num_nodes, num_replicas, local_bsz) using both
  tables (nodes clamped to 16).
* grad_sqr / grad_var are linear in M between the two nearest validated batch sizes, at
  the job's current epoch; EFFICIENCY(M) = r / S (Pollux Eqn 6 with the AdaScale gain).

These are *true* (simulated) values. Jobs never see the tables directly: they learn
their throughput model from the steps they run (see ``simulator``).
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.spatial import Delaunay

from pollux_launch.errors import UserError

TRACES_DIR = Path(__file__).resolve().parent / "traces"
MODELS_DIR = TRACES_DIR / "models"

# Per-model settings of the Pollux authors' simulator (README "How the Pollux authors'
# own simulator used these files").
MAX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80,
              "yolov3": 50}
MAX_LOCAL_BSZ_OVERRIDE = {"yolov3": 8}  # largest per-GPU batch that fits in memory
PINNED_BATCH_SIZE = {"ncf": 32768}  # ncf jobs ran at this batch size on one GPU
PINNED_MAX_REPLICAS = {"ncf": 1}
TABLE_MAX_NODES = 16  # the measurements cover up to 16 nodes

# Training state a live rescale sends to newcomers (and a restart reloads): fp32 weights
# plus optimizer slots. Parameter counts of the traced models as the Pollux paper names
# them (ResNet-18 on CIFAR-10, ResNet-50 on ImageNet, DeepSpeech2 on CMU-ARCTIC, YOLOv3
# on PASCAL VOC, BERT-base fine-tuned on SQuAD, NeuMF on MovieLens); approximate.
_PARAMS_AND_SLOTS = {
    "cifar10": (11.2e6, 1),  # SGD with momentum
    "imagenet": (25.6e6, 1),  # SGD with momentum
    "deepspeech2": (26.0e6, 1),  # SGD with momentum
    "yolov3": (61.9e6, 1),  # SGD with momentum
    "bert": (110e6, 2),  # AdamW: two moments
    "ncf": (1.0e6, 2),  # Adam
}
STATE_BYTES = {m: int(4 * n * (1 + k)) for m, (n, k) in _PARAMS_AND_SLOTS.items()}


def canonical_placement(counts) -> tuple[int, ...]:
    """Drop empty nodes and rotate to the lexicographically smallest rotation.

    A placement and its rotations are the same placement (README); ``(4, 2, 1)`` and
    ``(1, 4, 2)`` both become ``(1, 4, 2)``.
    """
    p = tuple(int(c) for c in counts if c)
    if not p:
        return p
    return min(p[i:] + p[:i] for i in range(len(p)))


def _read_csv(path: Path) -> dict[str, np.ndarray]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise TraceError(f"trace file {path} has no rows")
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}



class TraceError(UserError, ValueError):
    """A trace file or folder that is missing or empty."""

@dataclass
class ModelTrace:
    """All tables of one model plus memoised ground-truth lookups.

    Arrays are indexed ``[batch_size_index, epoch]`` for the validation tables.
    """

    name: str
    batch_sizes: np.ndarray  # validated M, ascending
    progress: np.ndarray  # (n_M, epochs) cumulative progress in M0-iterations
    grad_sqr: np.ndarray  # (n_M, epochs)
    grad_var: np.ndarray  # (n_M, epochs)
    placement_tables: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]]
    nd_points: np.ndarray  # (n, 3) num_nodes, num_replicas, local_bsz
    nd_values: np.ndarray  # (n, 2) step_time, sync_time
    min_local_bsz: int
    max_local_bsz: int
    max_epochs: int
    _cache: dict = field(default_factory=dict, repr=False)
    _nd: object = field(default=None, repr=False)

    # --- derived constants -------------------------------------------------------------
    @property
    def init_batch_size(self) -> int:
        return int(self.batch_sizes[0])

    @property
    def max_batch_size(self) -> int:
        return int(self.batch_sizes[-1])

    @functools.cached_property
    def epoch_progress(self) -> np.ndarray:
        """P(e) for e = 0..max_epochs: P(0) = 0, P(e) = min over M of progress row e."""
        ends = self.progress[:, : self.max_epochs].min(axis=0)
        return np.concatenate([[0.0], ends])

    @property
    def completion_progress(self) -> float:
        """Statistical progress (M0-iterations) at which a job of this model is done."""
        return float(self.epoch_progress[-1])

    @property
    def max_replicas(self) -> int:
        """Most replicas the tables cover (64); the simulator cannot go beyond."""
        return int(self.nd_points[:, 1].max())

    def epoch_of(self, progress: float) -> int:
        """Current (0-based) epoch of a job with this much progress."""
        e = int(np.searchsorted(self.epoch_progress, progress, side="right")) - 1
        return min(max(e, 0), self.max_epochs - 1)

    # --- gradient statistics -----------------------------------------------------------
    def grad_stats(self, batch_size, epoch: int):
        """(grad_sqr, grad_var) at total batch size M during ``epoch``, linear in M.

        M is clipped to the validated range; measured points are returned exactly.
        Vectorised over ``batch_size``.
        """
        m = np.clip(batch_size, self.batch_sizes[0], self.batch_sizes[-1])
        e = min(max(int(epoch), 0), self.progress.shape[1] - 1)
        sqr = np.interp(m, self.batch_sizes, self.grad_sqr[:, e])
        var = np.interp(m, self.batch_sizes, self.grad_var[:, e])
        return sqr, var

    def gain(self, batch_size, epoch: int):
        """AdaScale gain r = (var + sqr) / (var / S + sqr), S = M / M0 (Pollux Eqn 6)."""
        sqr, var = self.grad_stats(batch_size, epoch)
        scale = np.asarray(batch_size, dtype=float) / self.init_batch_size
        return (var + sqr) / (var / scale + sqr)

    def efficiency(self, batch_size, epoch: int):
        """EFFICIENCY(M) = r / S = (phi + M0) / (phi + M) (Pollux Eqn 6)."""
        scale = np.asarray(batch_size, dtype=float) / self.init_batch_size
        return self.gain(batch_size, epoch) / scale

    # --- step time ---------------------------------------------------------------------
    def step_time(self, placement, local_bsz: float) -> tuple[float, float]:
        """True (step_time, sync_time) of one step without accumulation.

        ``placement``: GPUs per occupied node (any order; canonicalised). Memoised.
        """
        key = (canonical_placement(placement), float(local_bsz))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._lookup(*key)
        return hit

    def step_times(self, placement, local_bsz) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`step_time` over an array of per-GPU batch sizes."""
        out = np.array([self.step_time(placement, b) for b in np.ravel(local_bsz)])
        shape = np.shape(local_bsz)
        return out[:, 0].reshape(shape), out[:, 1].reshape(shape)

    def _lookup(self, placement: tuple[int, ...], local_bsz: float) -> tuple[float, float]:
        if not placement:
            raise ValueError("step time of an empty placement is undefined")
        table = self.placement_tables.get(placement)
        if table is not None:
            bsz, step, sync = table
            if bsz[0] <= local_bsz <= bsz[-1]:  # measured placement: linear in local_bsz
                return float(np.interp(local_bsz, bsz, step)), float(
                    np.interp(local_bsz, bsz, sync))
        # Unmeasured (or outside its measured batch range): 3-D linear interpolation.
        nodes = min(len(placement), TABLE_MAX_NODES)
        x = np.array([nodes, sum(placement), local_bsz], dtype=float)
        step, sync = self._barycentric().interpolate(x)
        return float(step), float(sync)

    def _barycentric(self) -> _Barycentric:
        if self._nd is None:
            self._nd = _Barycentric(self.nd_points, self.nd_values)
        return self._nd


class _Barycentric:
    """Piecewise-linear interpolation on a Delaunay triangulation (as LinearNDInterpolator).

    Written out because scipy computes its per-simplex transforms lazily with one LAPACK
    call each, which takes seconds under a multi-threaded BLAS on a busy 2-core machine;
    here all transforms are one batched inverse. A point on a face shared by simplices
    gets the mean of their interpolants (lattice points make the triangulation
    non-conforming there; scipy picks one side arbitrarily). Outside the convex hull of
    the measurements the nearest measurement is used.
    """

    def __init__(self, points: np.ndarray, values: np.ndarray):
        self.points, self.values = points, values
        simplices = Delaunay(points).simplices
        verts = points[simplices]  # (S, 4, 3)
        edges = (verts[:, :3, :] - verts[:, 3:4, :]).transpose(0, 2, 1)
        det = np.linalg.det(edges)
        scale = np.abs(points).max(axis=0).prod()
        keep = np.abs(det) > 1e-12 * scale  # Qhull leaves flat slivers among lattice points
        self.simplices = simplices[keep]
        self.origin = verts[keep, 3, :]
        self.inverse = np.linalg.inv(edges[keep])

    def interpolate(self, x: np.ndarray) -> np.ndarray:
        bary = np.einsum("sij,sj->si", self.inverse, x - self.origin)
        weights = np.concatenate([bary, 1.0 - bary.sum(axis=1, keepdims=True)], axis=1)
        inside = np.flatnonzero((weights >= -1e-9).all(axis=1))
        if inside.size == 0:
            nearest = np.argmin(((self.points - x) ** 2).sum(axis=1))
            return self.values[nearest]
        # On a face shared by several simplices Qhull may have split a flat cell of the
        # lattice along different diagonals on either side; average those candidates.
        vals = np.einsum("sk,skv->sv", weights[inside], self.values[self.simplices[inside]])
        return vals.mean(axis=0)


def load_model(name: str, models_dir: Path | str = MODELS_DIR) -> ModelTrace:
    """Read one model's tables (``placements.csv``, ``scalability.csv``, validation-*)."""
    return _load_model(name, str(models_dir))


@functools.cache
def _load_model(name: str, models_dir: str) -> ModelTrace:
    root = Path(models_dir) / name
    if not root.is_dir():
        raise TraceError(f"no trace for model {name!r} under {models_dir}; "
                         f"known models: {', '.join(available_models(models_dir))}")
    val_files = sorted(root.glob("validation-*.csv"), key=lambda p: int(p.stem.split("-")[1]))
    batch_sizes = np.array([int(p.stem.split("-")[1]) for p in val_files])
    tables = [_read_csv(p) for p in val_files]
    epochs = min(len(t["progress"]) for t in tables)
    stack = lambda col: np.stack([t[col][:epochs].astype(float) for t in tables])  # noqa: E731

    pl = _read_csv(root / "placements.csv")
    pl_bsz, pl_step, pl_sync = (pl[c].astype(float) for c in ("local_bsz", "step_time",
                                                               "sync_time"))
    placement_tables = {}
    for pid in np.unique(pl["placement"]):
        idx = np.flatnonzero(pl["placement"] == pid)
        idx = idx[np.argsort(pl_bsz[idx], kind="stable")]
        key = canonical_placement(int(c) for c in pid)
        placement_tables[key] = (pl_bsz[idx], pl_step[idx], pl_sync[idx])

    sc = _read_csv(root / "scalability.csv")
    pl_nodes = np.array([len(p) for p in pl["placement"]], dtype=float)
    pl_repl = np.array([sum(int(c) for c in p) for p in pl["placement"]], dtype=float)
    xs = np.concatenate([np.stack([pl_nodes, pl_repl, pl_bsz], 1),
                         np.stack([sc[c].astype(float) for c in
                                   ("num_nodes", "num_replicas", "local_bsz")], 1)])
    ys = np.concatenate([np.stack([pl_step, pl_sync], 1),
                         np.stack([sc["step_time"].astype(float),
                                   sc["sync_time"].astype(float)], 1)])
    # Placements with the same (nodes, replicas, local_bsz) are averaged, as the
    # authors' simulator did; duplicate points would make the triangulation degenerate.
    uniq, inv = np.unique(xs, axis=0, return_inverse=True)
    inv = inv.ravel()
    counts = np.bincount(inv, minlength=len(uniq))[:, None]
    means = np.stack([np.bincount(inv, ys[:, k], len(uniq)) for k in range(2)], 1) / counts

    return ModelTrace(
        name=name,
        batch_sizes=batch_sizes,
        progress=stack("progress"),
        grad_sqr=stack("grad_sqr"),
        grad_var=stack("grad_var"),
        placement_tables=placement_tables,
        nd_points=uniq,
        nd_values=means,
        min_local_bsz=int(pl_bsz.min()),
        max_local_bsz=MAX_LOCAL_BSZ_OVERRIDE.get(name, int(pl_bsz.max())),
        max_epochs=MAX_EPOCHS.get(name, epochs),
    )


def available_models(models_dir: Path | str = MODELS_DIR) -> list[str]:
    """Names of the models with trace tables."""
    root = Path(models_dir)
    if not root.is_dir():
        raise TraceError(f"trace directory {root} does not exist")
    return sorted(p.name for p in root.iterdir() if (p / "placements.csv").is_file())


def parse_numbers(text: str) -> list[int]:
    """Workload numbers from ``"1-8"``, ``"1,3,5-6"`` or ``"none"`` (the benchmarks' flag)."""
    if text.strip().lower() == "none":
        return []
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out
