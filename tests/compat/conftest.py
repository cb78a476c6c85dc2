"""The compatibility suite's markers.

* ``restart_elastic``: needs ``pollux-run``'s restart-elastic mode (scripts that do not
  use the pollux API rescaled by stopping and restarting their workers with torchrun's
  variables, torchrun's command-line form, ``--max-restarts``;
  ``pytest -m "not restart_elastic"`` leaves them out).
* ``slow``: a test of this folder that takes longer than ~30 s on two cores.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "restart_elastic: needs pollux-run's restart-elastic mode (torchrun's "
        "contract for scripts without the pollux API)")
    config.addinivalue_line("markers", "slow: takes longer than ~30 s on two cores")

