# shellcheck shell=bash disable=SC2034
# Sourced by the build scripts: sets NVPLUG_VERSION to pyproject.toml's version
# and NVPLUG_PKG_VERSION to the same in the form dpkg and rpm sort right
# (a PEP 440 pre-release such as 0.2.0rc1 becomes 0.2.0~rc1).
NVPLUG_VERSION=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
if [ -z "$NVPLUG_VERSION" ]; then
    echo "no version in pyproject.toml" >&2
    exit 1
fi
NVPLUG_PKG_VERSION=$(printf '%s\n' "$NVPLUG_VERSION" | sed -E 's/^([0-9.]*[0-9])[.]?((a|b|rc|dev)[0-9]*)/\1~\2/')
