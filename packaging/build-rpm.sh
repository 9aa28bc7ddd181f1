#!/usr/bin/env bash
# Builds dist/nvplug-<version>-1.x86_64.rpm with rpmbuild (Debian's rpm package
# will do) and a private _topdir under build/rpm/top, and prints its path as the
# last line. PYTHON: see stage-wheels.sh; NVPLUG_BUILD_DIR and NVPLUG_DIST_DIR:
# see build-deb.sh.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# Relative to where the script is run from.
build=$(realpath -m "${NVPLUG_BUILD_DIR:-$root/build}")
dist=$(realpath -m "${NVPLUG_DIST_DIR:-$root/dist}")
cd "$root"
# shellcheck source=packaging/version.sh
. packaging/version.sh

rpm_version=$NVPLUG_PKG_VERSION
top=$build/rpm/top
stage=$build/rpm/stage
out=$dist/nvplug-${rpm_version}-1.x86_64.rpm

rm -rf "$top" "$stage"
mkdir -p "$top" "$stage" "$dist"
umask 022

bash packaging/stage-wheels.sh "$stage/opt/nvplug/wheels"
install -m 0755 packaging/setup-venv "$stage/opt/nvplug/setup-venv"
install -D -m 0644 systemd/nvplug.service "$stage/unit/nvplug.service"
install -D -m 0644 systemd/nvplug-mps.service "$stage/unit/nvplug-mps.service"
install -D -m 0644 packaging/tmpfiles/nvplug.conf "$stage/usr/lib/tmpfiles.d/nvplug.conf"
install -D -m 0644 packaging/config.yaml "$stage/etc/nvplug/config.yaml"
install -D -m 0644 README.md "$stage/usr/share/doc/nvplug/README.md"
# Node Problem Detector's custom-plugin config: operators point NPD at it (docs/npd.md).
install -D -m 0644 packaging/npd/nvplug-gpu-health.json "$stage/usr/share/nvplug/npd/nvplug-gpu-health.json"
# The unit's drop-in for the DRA plugin: operators install it when they turn DRA on (docs/dra.md).
install -D -m 0644 packaging/systemd/nvplug-dra.conf "$stage/usr/share/nvplug/systemd/nvplug-dra.conf"
install -D -m 0644 packaging/kubernetes/nvplug-node-identity.yaml "$stage/usr/share/nvplug/kubernetes/nvplug-node-identity.yaml"
install -D -m 0644 packaging/systemd/nvplug-metrics.conf "$stage/usr/share/nvplug/systemd/nvplug-metrics.conf"
install -D -m 0644 packaging/grafana/nvplug-gpus.json "$stage/usr/share/nvplug/grafana/nvplug-gpus.json"
mkdir -p "$stage/usr/bin"
ln -s /opt/nvplug/venv/bin/nvplug "$stage/usr/bin/nvplug"

# --nodeps: nothing is compiled, and Debian's rpm database is empty anyway.
rpmbuild -bb --quiet --nodeps --target x86_64 \
    --define "_topdir $top" \
    --define "nvplug_version $rpm_version" \
    --define "nvplug_stage $stage" \
    packaging/rpm.spec >&2

built=$top/RPMS/x86_64/nvplug-${rpm_version}-1.x86_64.rpm
if [ ! -f "$built" ]; then
    echo "build-rpm: rpmbuild did not produce $built" >&2
    exit 1
fi
cp "$built" "$out"
echo "$out"
