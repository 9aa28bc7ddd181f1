#!/usr/bin/env bash
# The real-GPU check, for a machine with an NVIDIA GPU and no network access.
# It prints the GPUs that NVML reports with all their fields, the NVML event
# types each supports, a GPU's telemetry reads alone and side by side (wall
# and CPU), its figures read one call each or as fields in one call, the
# daemon's start-up time against the kubelet stand-in, an Allocate response,
# scrapes of /metrics (wall and the daemon's CPU) and the stop's time. It
# finishes well within 4 minutes.
#
# Python packages: if .whl/ holds wheels, they are installed from there (no
# network needed). Fill it on a machine with network access, for the target's
# Python (here 3.12 on x86-64):
#   python3 -m pip download --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux_2_28_x86_64 -d .whl \
#       grpcio protobuf nvidia-ml-py pyudev tenacity pyyaml
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
site=$(mktemp -d /tmp/nvplug-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec timeout 200 "$py" bench/real_gpu.py
