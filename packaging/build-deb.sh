#!/usr/bin/env bash
# Builds dist/nvplug_<version>-1_amd64.deb from a staged tree with dpkg-deb
# (no debhelper needed) and prints its path as the last line.
# PYTHON: see stage-wheels.sh. NVPLUG_MAINTAINER overrides the Maintainer field.
# NVPLUG_BUILD_DIR (default build/) and NVPLUG_DIST_DIR (default dist/) move
# the staging area and the output, e.g. for parallel test runs.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
# Relative to where the script is run from.
build=$(realpath -m "${NVPLUG_BUILD_DIR:-$root/build}")
dist=$(realpath -m "${NVPLUG_DIST_DIR:-$root/dist}")
cd "$root"
# shellcheck source=packaging/version.sh
. packaging/version.sh

deb_version=${NVPLUG_PKG_VERSION}-1
maintainer=${NVPLUG_MAINTAINER:-nvplug maintainers <nvplug@localhost>}
stage=$build/deb/nvplug
out=$dist/nvplug_${deb_version}_amd64.deb

rm -rf "$stage"
mkdir -p "$stage" "$dist"
umask 022

bash packaging/stage-wheels.sh "$stage/opt/nvplug/wheels"
install -m 0755 packaging/setup-venv "$stage/opt/nvplug/setup-venv"
install -D -m 0644 systemd/nvplug.service "$stage/lib/systemd/system/nvplug.service"
install -D -m 0644 systemd/nvplug-mps.service "$stage/lib/systemd/system/nvplug-mps.service"
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

mkdir "$stage/DEBIAN"
installed_size=$(du -sk --apparent-size "$stage" | cut -f1)
sed -e "s|@VERSION@|$deb_version|" -e "s|@MAINTAINER@|$maintainer|" \
    -e "s|@INSTALLED_SIZE@|$installed_size|" packaging/deb/control.in >"$stage/DEBIAN/control"
install -m 0644 packaging/deb/conffiles "$stage/DEBIAN/conffiles"
install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$stage/DEBIAN/"
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -print0 | LC_ALL=C sort -z |
    xargs -0 md5sum | sed 's|  \./|  |') >"$stage/DEBIAN/md5sums"
chmod 0644 "$stage/DEBIAN/md5sums"

dpkg-deb --root-owner-group -Zxz --build "$stage" "$out" >&2
echo "$out"
