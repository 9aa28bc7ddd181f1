#!/usr/bin/env bash
# Stages every wheel that nvplug's deb and RPM ship into DEST (made if missing,
# its old *.whl removed): the pinned runtime dependencies from
# packaging/requirements.txt and a wheel of nvplug built from this tree.
#
# The dependencies are downloaded once per requirements hash into a cache
# (default build/wheel-cache/<hash>, or $NVPLUG_WHEEL_CACHE/<hash>), so
# rebuilds don't download again. nvplug's own wheel is built every time, from
# a copy of the tree so that a stale build/ can never leak into it.
#
# Usage: packaging/stage-wheels.sh DEST
# PYTHON: a Python with pip that runs the downloads and the wheel build
#         (default .venv/bin/python if present, else python3). Any version
#         works: the target (CPython 3.11, x86-64) is given explicitly.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:?usage: stage-wheels.sh DEST}
reqs=$root/packaging/requirements.txt

python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$root/.venv/bin/python" ]; then python=$root/.venv/bin/python; else python=python3; fi
fi
if ! "$python" -m pip --version >/dev/null 2>&1; then
    echo "stage-wheels: $python has no pip; run 'make setup' or set PYTHON" >&2
    exit 1
fi
pip=("$python" -m pip --disable-pip-version-check)

# The interpreter and platforms the packages target: Debian bookworm's and
# EL8/EL9's python3.11 on x86-64 glibc >= 2.28.
target=(--only-binary=:all: --python-version 3.11 --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)

key=$({ cat "$reqs"; echo "${target[*]}"; } | sha256sum | cut -c1-16)
cache_root=${NVPLUG_WHEEL_CACHE:-$root/build/wheel-cache}
cache=$cache_root/$key
mkdir -p "$cache_root"
# One download at a time per cache (parallel builds, parallel test runs).
exec 9>"$cache_root/.lock"
flock 9
if [ ! -e "$cache/.complete" ]; then
    echo "stage-wheels: downloading the pinned wheels into $cache" >&2
    tmp=$(mktemp -d "$cache_root/.download.XXXXXX")
    chmod 0755 "$tmp"
    # --require-hashes: every file must match its pin, and every dependency must be pinned.
    if ! "${pip[@]}" download --quiet --require-hashes --dest "$tmp" "${target[@]}" -r "$reqs" >&2; then
        rm -rf "$tmp"
        exit 1
    fi
    touch "$tmp/.complete"
    rm -rf "$cache"
    mv "$tmp" "$cache"
fi
exec 9>&-

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Only what the wheel is built from; caches and built libraries stay behind.
shopt -s nullglob
extra=()
for f in "$root"/LICEN[CS]E* "$root"/COPYING* "$root"/NOTICE* "$root"/AUTHORS* \
    "$root"/setup[.]py "$root"/setup[.]cfg "$root"/MANIFEST[.]in; do
    extra+=("${f#"$root"/}")
done
shopt -u nullglob
mkdir "$work/src"
tar -C "$root" --exclude=__pycache__ --exclude='*.so' --exclude='*.so.*' --exclude='*.egg-info' \
    -cf - pyproject.toml README.md nvplug "${extra[@]}" | tar -C "$work/src" -xf -
"${pip[@]}" wheel --quiet --no-deps --wheel-dir "$work/out" "$work/src" >&2

built=("$work"/out/nvplug-*.whl)
if [ ${#built[@]} -ne 1 ] || [ ! -e "${built[0]}" ]; then
    echo "stage-wheels: expected one nvplug wheel, got: ${built[*]}" >&2
    exit 1
fi

mkdir -p "$dest"
rm -f "$dest"/*.whl
cp "$cache"/*.whl "${built[0]}" "$dest"/
