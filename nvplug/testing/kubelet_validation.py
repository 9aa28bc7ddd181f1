"""What the kubelet checks in a Register request: the API version and the resource name."""

from __future__ import annotations

import re

from nvplug.protos import API_VERSION
from nvplug.protos import deviceplugin_pb2 as pb

_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _qualified_name_error(value: str) -> str | None:
    """k8s IsQualifiedName: optional DNS-1123 subdomain prefix, '/', name of <= 63 chars."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            return "prefix part must be non-empty"
        if len(prefix) > 253:
            return f"prefix part must be no more than 253 characters (got {len(prefix)})"
        if not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return f"prefix part {prefix!r} must be a lowercase RFC 1123 subdomain"
    else:
        return "a qualified name must contain at most one '/'"
    if not name:
        return "name part must be non-empty"
    if len(name) > 63:
        return f"name part must be no more than 63 characters (got {len(name)})"
    if not _QUALIFIED_NAME.fullmatch(name):
        return (
            f"name part {name!r} must consist of alphanumerics, '-', '_' or '.', and start and end with an alphanumeric"
        )
    return None


def extended_resource_name_error(name: str) -> str | None:
    """Why the kubelet would reject `name` as a device plugin resource, or None.

    Mirrors v1helper.IsExtendedResourceName: not native (has '/', no 'kubernetes.io/'),
    not 'requests.'-prefixed, and 'requests.' + name is a qualified name -- so the
    domain prefix is effectively limited to 244 characters.
    """
    if "/" not in name:
        return f"resource name {name!r} must contain '/' (an extended resource is domain/name)"
    if "kubernetes.io/" in name:
        return f"resource name {name!r} is in the reserved kubernetes.io namespace"
    if name.startswith("requests."):
        return f"resource name {name!r} must not start with 'requests.'"
    err = _qualified_name_error("requests." + name)
    if err is not None:
        return f"resource name {name!r} is not a qualified name: {err}"
    return None


def registration_error(req: pb.RegisterRequest) -> str | None:
    if req.version != API_VERSION:
        return (
            f"requested API version {req.version!r} is not supported by kubelet; "
            f"supported versions are [{API_VERSION!r}] (resource {req.resource_name!r})"
        )
    return extended_resource_name_error(req.resource_name)
