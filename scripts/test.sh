#!/usr/bin/env bash
# Installs everything the tests need and runs the whole suite:
#   Debian's etcd-server (a real etcd for the store tests), slurm-wlm and munge (a real
#   Slurm) and g++ (DeepSpeed's CPU op JIT, the Horovod build), the .venv with every extra, Horovod (built once, then installed
#   from a wheel cached outside the repo: scripts/install-horovod.sh), then ruff and pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v slurmctld >/dev/null 2>&1 || need_apt+=(slurm-wlm)  # a real Slurm (tests/e2e/slurm.py)
command -v munged >/dev/null 2>&1 || need_apt+=(munge)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "test.sh: installing Debian packages: ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# (this machine's pip config names local indexes that may be absent: silence only that noise)
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2> >(grep -v '^WARNING: Location' >&2)

scripts/install-horovod.sh

.venv/bin/ruff check .
# the venv's tools first, as in pollux-run's workers: DeepSpeed's CPU op JIT then builds
# with one ninja everywhere (the venv's and Debian's rebuild each other's cache)
export PATH="$PWD/.venv/bin:$PATH"
# many worker processes share 2 cores in the tests: one BLAS/OpenMP thread each
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
exec .venv/bin/pytest "$@"
