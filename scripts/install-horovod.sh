#!/usr/bin/env bash
# Installs Horovod 0.28.1 (PyTorch + Gloo, CPU operations on Gloo, no MPI/TF/MXNet) into
# the project's .venv, for `pollux-run --framework horovod` and tests/horovod.
#
#   scripts/install-horovod.sh            # idempotent: no-op when horovod.torch imports
#   POLLUX_WHEEL_CACHE=/path scripts/install-horovod.sh
#
# Horovod 0.28.1 ships only as source and its CMake files pin C++14, while torch >= 2.1
# headers need C++17: the build goes through a compiler front script that rewrites the
# -std flag. The built wheel is kept in a cache OUTSIDE the repo, keyed by horovod, torch
# and python versions, so later runs (and CI) install it in seconds; a fresh machine
# builds it (~10 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
PY="${POLLUX_VENV:-$PWD/.venv}/bin/python"
[ -x "$PY" ] || { echo "install-horovod.sh: no virtualenv at ${PY%/bin/python}; run scripts/test.sh (or python3 -m venv .venv) first" >&2; exit 1; }

if "$PY" -c "import horovod, horovod.torch, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
    echo "install-horovod.sh: horovod $HOROVOD_VERSION with torch support is already installed"
    exit 0
fi

versions="$("$PY" -c 'import sys, torch; print(torch.__version__.replace("+", "_"), "py%d%d" % sys.version_info[:2])')"
read -r torch_version py_version <<<"$versions"
cache="${POLLUX_WHEEL_CACHE:-$HOME/.cache/pollux-launch/wheels}/horovod-$HOROVOD_VERSION-torch$torch_version-$py_version"
mkdir -p "$cache"

wheel="$(ls "$cache"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)"
if [ -z "$wheel" ]; then
    if ! command -v cmake >/dev/null 2>&1 || ! command -v g++ >/dev/null 2>&1; then
        echo "install-horovod.sh: installing Debian packages cmake g++"
        SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq cmake g++ >/dev/null
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    # Compiler front: C++14 -> C++17 (torch headers), everything else passed through as is.
    cat >"$work/cxx17" <<'EOF'
#!/bin/sh
for a; do
    shift
    case "$a" in
        -std=c++14) a=-std=c++17 ;;
        -std=gnu++14) a=-std=gnu++17 ;;
    esac
    set -- "$@" "$a"
done
exec g++ "$@"
EOF
    chmod +x "$work/cxx17"
    echo "install-horovod.sh: building horovod $HOROVOD_VERSION wheel into $cache (about 10 minutes on 2 cores)"
    start=$SECONDS
    # pip must be on PATH for horovod's setup.py to find the venv's torch via `python`.
    PATH="$(dirname "$PY"):$PATH" \
    CXX="$work/cxx17" \
    CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO \
    MAKEFLAGS="-j$(nproc)" \
        "$PY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
            -w "$work/out" "horovod==$HOROVOD_VERSION"
    cp "$work"/out/horovod-"$HOROVOD_VERSION"-*.whl "$cache"/
    wheel="$(ls "$cache"/horovod-"$HOROVOD_VERSION"-*.whl | head -n 1)"
    echo "install-horovod.sh: built $(basename "$wheel") in $((SECONDS - start)) s"
fi

"$PY" -m pip install -q --disable-pip-version-check "$wheel"
"$PY" -c "import horovod, horovod.torch; print('install-horovod.sh: horovod', horovod.__version__, 'with torch support installed')"
