"""Fixtures of the GPU suite (see ``test_gpu_rescale.py`` for how to run it).

* ``device``   parametrised: ``cpu`` (``cpu_sanity``: the same test body on any machine,
               a check of the harness) and ``cuda`` (skipped without a GPU).
* ``gpu_job``  ``gpu_job(device, backend="", amp=False)`` -> a ``gpu_harness.GpuJob``:
               real ``gpu_worker.py`` processes on an embedded store (under ``tmp_path``,
               key prefix from ``store_prefix`` in ``tests/conftest.py``); the test plays
               the coordinator. Workers still running afterwards are killed.

Every test module here sets ``pytestmark = pytest.mark.cuda``: without CUDA its tests
are skipped (``pytest_collection_modifyitems`` below), all but their ``cpu_sanity``
variants - those whose ``device`` parameter is ``cpu`` (``pytest tests/gpu -m cpu_sanity``
runs just them).
"""

from __future__ import annotations

import pytest
from gpu_harness import CUDA, NO_CUDA, GpuJob


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (tests/gpu); skipped without "
                            "one, except its cpu_sanity variants")
    config.addinivalue_line("markers", "cpu_sanity: the cpu variant of a GPU test: runs "
                            "anywhere, checks the harness")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A ``cuda`` test whose ``device`` parameter is ``cpu`` is a ``cpu_sanity`` variant;
    without CUDA every other ``cuda`` test is skipped."""
    for item in items:
        if not item.get_closest_marker("cuda"):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cpu":
            item.add_marker("cpu_sanity")
        elif not CUDA:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """``cpu`` (a sanity check of the harness) or ``cuda`` (skipped without a GPU)."""
    return request.param


@pytest.fixture
def gpu_job(tmp_path, store_prefix):
    """``gpu_job(device, backend="", amp=False)``: a new ``GpuJob`` (``backend`` ""
    leaves the rendezvous its default: nccl with a GPU)."""
    jobs: list[GpuJob] = []

    def make(device: str, backend: str = "", amp: bool = False) -> GpuJob:
        log_dir = tmp_path / f"job{len(jobs)}"
        log_dir.mkdir()
        env = {"GPU_DEVICE": device, "GPU_BACKEND": backend, "GPU_AMP": "1" if amp else "0"}
        jobs.append(GpuJob(f"embedded://{tmp_path / 'store.db'}", store_prefix, log_dir, env))
        return jobs[-1]

    yield make
    for job in jobs:
        job.stop()
