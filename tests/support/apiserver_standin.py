"""A Kubernetes API server stand-in serving resource.k8s.io ResourceSlices and ResourceClaims over real HTTP/1.1.

It answers JSON on a TCP socket on 127.0.0.1 with the API server's REST conventions
(discovery, create/get/update/delete, field selectors, resourceVersion preconditions,
dryRun=All on create and update) and its metav1.Status error bodies, and validates
ResourceSlices the way the real server does (the shapes, limits and field rules a DRA
driver's client can get wrong), so that a kubelet plugin's own HTTP client is tested
on the wire rather than against a mock. Objects live in memory, standing in for etcd:
they survive stop() and restart() unless restart(keep_state=False) is asked for.

Device taints (KEP-5055, DRADeviceTaints) are kept as a server with that gate on keeps
them: at most 16 a device, at most 64 devices in a slice with any taint, and a taint's
timeAdded set to the time of the write (create or update) that leaves it out. With
FakeApiServer(taints=False) the gate is off: taints are dropped from what is written,
silently, unless the stored slice already has some. edit_slice() is an admin's
`kubectl edit` of a stored slice, written as a PUT is.

ResourceSlices can be watched (`?watch=true`): a chunked stream of one JSON event a
line, replayed from a bounded history of writes for a resourceVersion, with bookmarks,
410 Gone (an ERROR event) once that history is compacted, and timeoutSeconds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hmac
import json
import random
import re
import select
import socket
import socketserver
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

from nvplug.testing.net_namespace import NetNamespace
from support.admission_policies import AdmissionPolicies, User

Obj = dict[str, Any]

GROUP = "resource.k8s.io"
# Versions whose devices carry their attributes, capacity and taints under "basic".
BASIC_SHAPE_VERSIONS = frozenset({"v1alpha3", "v1beta1"})
FLAT_SHAPE_VERSIONS = frozenset({"v1beta2", "v1"})
MAX_DEVICES = 128
# The limit when any device has taints or consumes counters (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters).
MAX_DEVICES_WITH_TAINTS = 64
MAX_TAINTS_PER_DEVICE = 16
MAX_ATTRIBUTES_AND_CAPACITY = 32
TAINT_EFFECTS = ("NoSchedule", "NoExecute", "None")
METHODS = frozenset({"GET", "POST", "PUT", "DELETE"})
SLICE_FIELD_SELECTORS = ("metadata.name", "spec.driver", "spec.nodeName")

_SPEC_FIELDS = frozenset(
    {"driver", "pool", "nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection", "devices", "sharedCounters"}
)
# Fields of a v1 Device besides its name; in v1beta1 they are those of BasicDevice.
_DEVICE_FIELDS = frozenset(
    {
        "attributes",
        "capacity",
        "consumesCounters",
        "nodeName",
        "nodeSelector",
        "allNodes",
        "taints",
        "bindsToNode",
        "bindingConditions",
        "bindingFailureConditions",
        "allowMultipleAllocations",
    }
)
_ATTRIBUTE_TYPES = ("int", "bool", "string", "version")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# What metav1.Time parses (Go's time.RFC3339): a date, T, a time, and a zone.
_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(\.(0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*)?"
    r"(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$"
)
# The API server's alphabet for generateName suffixes: no vowels, so no words.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_GENERATED_SUFFIX = 5
_MAX_GENERATE_NAME_PREFIX = 63 - _GENERATED_SUFFIX
_MAX_LINE = 65536
# Events a watch can still be replayed from; older resourceVersions are compacted (410 Gone).
WATCH_HISTORY = 1000
# How often the API server sends a watch a bookmark, when it asked for them.
BOOKMARK_SECONDS = 60.0
# How often an idle watch stream looks for its client gone or its end asked.
_WATCH_POLL = 0.1


class ApiError(Exception):
    """An answer other than success, carried as the metav1.Status the API server sends."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: Obj | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _not_found_path() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def _method_not_allowed() -> ApiError:
    return ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _object_error(code: int, reason: str, resource: str, name: str, what: str) -> ApiError:
    return ApiError(
        code,
        reason,
        f'{resource}.{GROUP} "{name}" {what}',
        {"name": name, "group": GROUP, "kind": resource},
    )


def _conflict(name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on resourceslices.{GROUP} "{name}": {why}',
        {"name": name, "group": GROUP, "kind": "resourceslices"},
    )


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


class _Errors:
    """Field errors gathered as the API server's validation reports them, all at once."""

    def __init__(self) -> None:
        self.causes: list[tuple[str, str, str]] = []

    def add(self, reason: str, field: str, detail: str) -> None:
        self.causes.append((reason, field, detail))

    def required(self, field: str, detail: str = "") -> None:
        self.add("FieldValueRequired", field, "Required value" + (f": {detail}" if detail else ""))

    def invalid(self, field: str, value: Any, detail: str) -> None:
        self.add("FieldValueInvalid", field, f"Invalid value: {_short(value)}: {detail}")

    def forbidden(self, field: str, detail: str) -> None:
        self.add("FieldValueForbidden", field, f"Forbidden: {detail}")

    def too_many(self, field: str, count: int, limit: int) -> None:
        self.add("FieldValueTooMany", field, f"Too many: {count}: must have at most {limit} items")

    def duplicate(self, field: str, value: Any) -> None:
        self.add("FieldValueDuplicate", field, f"Duplicate value: {_short(value)}")

    def not_supported(self, field: str, value: Any, supported: tuple[str, ...]) -> None:
        choices = ", ".join(f'"{s}"' for s in supported)
        self.add("FieldValueNotSupported", field, f"Unsupported value: {_short(value)}: supported values: {choices}")

    def raise_if_any(self, kind: str, name: str, group: str = GROUP) -> None:
        if not self.causes:
            return
        parts = [f"{field}: {detail}" for _, field, detail in self.causes]
        summary = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
        raise ApiError(
            422,
            "Invalid",
            f'{kind}.{group} "{name}" is invalid: {summary}',
            {
                "name": name,
                "group": group,
                "kind": kind,
                "causes": [{"reason": r, "message": d, "field": f} for r, f, d in self.causes],
            },
        )


def _is_int(value: Any) -> bool:
    # JSON true/false decode to bool, which Python counts as int.
    return isinstance(value, int) and not isinstance(value, bool)


def _qualified_name_error(name: Any) -> str | None:
    """Why an attribute or capacity name is not a C identifier with an optional DNS-subdomain prefix."""
    if not isinstance(name, str) or not name:
        return "must be a non-empty string"
    domain, _, ident = name.rpartition("/")
    if domain and (len(domain) > 63 or not _DNS_SUBDOMAIN.match(domain)):
        return "the domain must be a DNS subdomain of at most 63 characters"
    if len(ident) > 32 or not _C_IDENTIFIER.match(ident):
        return "the name must be a C identifier of at most 32 characters"
    return None


def _label_key_error(key: Any) -> str | None:
    if not isinstance(key, str) or not key:
        return "must be a non-empty string"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return "the prefix must be a DNS subdomain"
    if len(name) > 63 or not _LABEL_NAME.match(name):
        return "the name must be at most 63 alphanumeric characters, '-', '_' or '.', starting and ending alphanumeric"
    return None


def _validate_attribute(value: Any, field: str, errs: _Errors) -> None:
    if not isinstance(value, dict):
        errs.invalid(field, value, "must be an object with exactly one of int, bool, string or version")
        return
    unknown = sorted(set(value) - set(_ATTRIBUTE_TYPES))
    for key in unknown:
        errs.forbidden(f"{field}.{key}", "unknown field")
    present = [t for t in _ATTRIBUTE_TYPES if t in value]
    if len(present) != 1:
        errs.invalid(field, value, "exactly one value must be specified")
        return
    kind = present[0]
    item = value[kind]
    if kind == "int" and not _is_int(item):
        errs.invalid(f"{field}.int", item, "must be an integer")
    elif kind == "bool" and not isinstance(item, bool):
        errs.invalid(f"{field}.bool", item, "must be a boolean")
    elif kind == "string" and (not isinstance(item, str) or len(item) > 64):
        errs.invalid(f"{field}.string", item, "must be a string of at most 64 characters")
    elif kind == "version" and (not isinstance(item, str) or len(item) > 64 or not _SEMVER.match(item)):
        errs.invalid(f"{field}.version", item, "must be a semantic version of at most 64 characters")


def _validate_capacity(value: Any, field: str, errs: _Errors) -> None:
    if not isinstance(value, dict):
        errs.invalid(field, value, 'must be an object with a "value" quantity')
        return
    for key in sorted(set(value) - {"value", "requestPolicy"}):
        errs.forbidden(f"{field}.{key}", "unknown field")
    quantity = value.get("value")
    if quantity is None:
        errs.required(f"{field}.value")
    elif not isinstance(quantity, str) or not _QUANTITY.match(quantity):
        errs.invalid(f"{field}.value", quantity, "must be a quantity string such as '81559Mi'")


def _parse_time(value: Any) -> datetime | None:
    """A metav1.Time as JSON carries it (RFC 3339), or None when it is not one."""
    match = _RFC3339.match(value) if isinstance(value, str) else None
    if match is None:
        return None
    # The fraction is dropped, as metav1.Time keeps whole seconds; Python 3.10's parser takes no "Z".
    stamp, _, zone = match.groups()
    try:
        return datetime.fromisoformat(stamp + ("+00:00" if zone == "Z" else zone))
    except ValueError:
        return None


def _validate_taints(taints: Any, field: str, errs: _Errors) -> None:
    if not isinstance(taints, list):
        errs.invalid(field, taints, "must be a list")
        return
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        errs.too_many(field, len(taints), MAX_TAINTS_PER_DEVICE)
    for i, taint in enumerate(taints):
        path = f"{field}[{i}]"
        if not isinstance(taint, dict):
            errs.invalid(path, taint, "must be an object")
            continue
        for key in sorted(set(taint) - {"key", "value", "effect", "timeAdded"}):
            errs.forbidden(f"{path}.{key}", "unknown field")
        key_error = _label_key_error(taint.get("key"))
        if "key" not in taint:
            errs.required(f"{path}.key")
        elif key_error:
            errs.invalid(f"{path}.key", taint["key"], key_error)
        value = taint.get("value", "")
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errs.invalid(f"{path}.value", value, "must be a label value of at most 63 characters")
        if "effect" not in taint:
            errs.required(f"{path}.effect")
        elif taint["effect"] not in TAINT_EFFECTS:
            errs.not_supported(f"{path}.effect", taint["effect"], TAINT_EFFECTS)
        added = taint.get("timeAdded")
        if added is not None and _parse_time(added) is None:
            errs.invalid(f"{path}.timeAdded", added, "must be an RFC 3339 time such as 2006-01-02T15:04:05Z")


def _validate_device_fields(fields: Obj, device_path: str, field_path: str, errs: _Errors) -> None:
    """Attributes, capacity and taints: on the device (v1beta2, v1) or under basic (v1beta1)."""
    attributes = fields.get("attributes", {})
    capacity = fields.get("capacity", {})
    if not isinstance(attributes, dict):
        errs.invalid(f"{field_path}.attributes", attributes, "must be a map")
        attributes = {}
    if not isinstance(capacity, dict):
        errs.invalid(f"{field_path}.capacity", capacity, "must be a map")
        capacity = {}
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITY:
        errs.invalid(
            device_path,
            total,
            f"the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITY}",
        )
    for name, value in attributes.items():
        path = f"{field_path}.attributes[{name}]"
        name_error = _qualified_name_error(name)
        if name_error:
            errs.invalid(path, name, name_error)
        _validate_attribute(value, path, errs)
    for name, value in capacity.items():
        path = f"{field_path}.capacity[{name}]"
        name_error = _qualified_name_error(name)
        if name_error:
            errs.invalid(path, name, name_error)
        _validate_capacity(value, path, errs)
    if "taints" in fields:
        _validate_taints(fields["taints"], f"{field_path}.taints", errs)


def _validate_device(device: Any, version: str, path: str, errs: _Errors) -> str | None:
    """Check one device in the shape of `version`; returns its name when it has a usable one."""
    if not isinstance(device, dict):
        errs.invalid(path, device, "must be an object")
        return None
    name = device.get("name")
    if name in (None, ""):
        errs.required(f"{path}.name")
        name = None
    elif not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.match(name):
        errs.invalid(f"{path}.name", name, "must be a DNS label: at most 63 lowercase alphanumerics or '-'")
        name = None
    if version in BASIC_SHAPE_VERSIONS:
        for key in sorted(set(device) - {"name", "basic"}):
            if key in _DEVICE_FIELDS:
                errs.forbidden(f"{path}.{key}", f"in {GROUP}/{version} this field goes under basic")
            else:
                errs.forbidden(f"{path}.{key}", "unknown field")
        basic = device.get("basic")
        if basic is not None:
            if not isinstance(basic, dict):
                errs.invalid(f"{path}.basic", basic, "must be an object")
            else:
                for key in sorted(set(basic) - _DEVICE_FIELDS):
                    errs.forbidden(f"{path}.basic.{key}", "unknown field")
                _validate_device_fields(basic, path, f"{path}.basic", errs)
    else:
        for key in sorted(set(device) - {"name"} - _DEVICE_FIELDS):
            if key == "basic":
                errs.forbidden(f"{path}.basic", f"{GROUP}/{version} has no basic: fields go on the device itself")
            else:
                errs.forbidden(f"{path}.{key}", "unknown field")
        _validate_device_fields(device, path, path, errs)
    return name


def _validate_slice_spec(spec: Any, version: str, errs: _Errors) -> None:
    if not isinstance(spec, dict):
        errs.required("spec")
        return
    for key in sorted(set(spec) - _SPEC_FIELDS):
        errs.forbidden(f"spec.{key}", "unknown field")

    driver = spec.get("driver")
    if driver in (None, ""):
        errs.required("spec.driver")
    elif not isinstance(driver, str) or len(driver) > 63 or not _DNS_SUBDOMAIN.match(driver):
        errs.invalid("spec.driver", driver, "must be a DNS subdomain of at most 63 characters")

    pool = spec.get("pool")
    if not isinstance(pool, dict):
        errs.required("spec.pool")
    else:
        pool_name = pool.get("name")
        if pool_name in (None, ""):
            errs.required("spec.pool.name")
        elif (
            not isinstance(pool_name, str)
            or len(pool_name) > 253
            or not all(_DNS_SUBDOMAIN.match(part) for part in pool_name.split("/"))
        ):
            errs.invalid("spec.pool.name", pool_name, "must be DNS subdomains separated by '/'")
        generation = pool.get("generation")
        if generation is None:
            errs.required("spec.pool.generation")
        elif not _is_int(generation) or generation < 0:
            errs.invalid("spec.pool.generation", generation, "must be an integer greater than or equal to 0")
        count = pool.get("resourceSliceCount")
        if count is None:
            errs.required("spec.pool.resourceSliceCount")
        elif not _is_int(count) or count < 1:
            errs.invalid("spec.pool.resourceSliceCount", count, "must be an integer greater than or equal to 1")

    node_name = spec.get("nodeName")
    if node_name not in (None, "") and (not isinstance(node_name, str) or not _DNS_SUBDOMAIN.match(node_name)):
        errs.invalid("spec.nodeName", node_name, "must be a DNS subdomain")
    chosen = [
        node_name not in (None, ""),
        spec.get("allNodes") is True,
        spec.get("nodeSelector") is not None,
        spec.get("perDeviceNodeSelection") is True,
    ]
    if sum(chosen) != 1:
        errs.invalid(
            "spec",
            {k: spec[k] for k in ("nodeName", "allNodes", "nodeSelector", "perDeviceNodeSelection") if k in spec},
            "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required",
        )

    devices = spec.get("devices", [])
    if not isinstance(devices, list):
        errs.invalid("spec.devices", devices, "must be a list")
        return
    heavy = any(fields.get("taints") or fields.get("consumesCounters") for fields in _device_fields(devices))
    limit = MAX_DEVICES_WITH_TAINTS if heavy else MAX_DEVICES
    if len(devices) > limit:
        errs.too_many("spec.devices", len(devices), limit)
    seen: set[str] = set()
    for i, device in enumerate(devices):
        name = _validate_device(device, version, f"spec.devices[{i}]", errs)
        if name is None:
            continue
        if name in seen:
            errs.duplicate(f"spec.devices[{i}].name", name)
        seen.add(name)


def _device_fields(devices: Any) -> Iterator[Obj]:
    """Where devices keep their fields: each device (v1beta2, v1) and its basic (v1beta1), those that are maps."""
    if not isinstance(devices, list):
        return
    for device in devices:
        if isinstance(device, dict):
            yield device
            if isinstance(device.get("basic"), dict):
                yield device["basic"]


def _spec_devices(obj: Obj) -> Any:
    spec = obj.get("spec")
    return spec.get("devices") if isinstance(spec, dict) else None


def _refuse_effect_none(obj: Obj, errs: _Errors) -> None:
    """Before Kubernetes 1.35 a taint's effect is NoSchedule or NoExecute: None is not supported."""
    for i, device in enumerate(_spec_devices(obj) or []):
        fields = device.get("basic", device) if isinstance(device, dict) else {}
        for j, taint in enumerate(fields.get("taints") or [] if isinstance(fields, dict) else []):
            if isinstance(taint, dict) and taint.get("effect") == "None":
                where = "basic.taints" if "basic" in device else "taints"
                errs.not_supported(f"spec.devices[{i}].{where}[{j}].effect", "None", ("NoSchedule", "NoExecute"))


def _has_taints(obj: Obj) -> bool:
    return any(fields.get("taints") for fields in _device_fields(_spec_devices(obj)))


def _prepare_slice(obj: Obj, keep_taints: bool, now: str) -> None:
    """What the API server does to a written slice before validating it: gated-off taints dropped, timeAdded set.

    A timeAdded left out becomes the write's time, on update too; one given is kept, in
    metav1.Time's form (UTC, to the second). One that is no time is left to validation.
    """
    for fields in _device_fields(_spec_devices(obj)):
        if not keep_taints:
            fields.pop("taints", None)
        taints = fields.get("taints")
        for taint in taints if isinstance(taints, list) else []:
            if not isinstance(taint, dict):
                continue
            added = taint.get("timeAdded")
            parsed = _parse_time(added)
            if added is None:
                taint["timeAdded"] = now
            elif parsed is not None:
                taint["timeAdded"] = parsed.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _devices_in_shape(devices: list[Obj], version: str) -> list[Obj]:
    """The devices converted between the v1beta1 (basic) and the v1beta2/v1 (flat) shape."""
    out: list[Obj] = []
    for device in devices:
        flat: Obj = {k: v for k, v in device.items() if k != "basic"}
        flat.update(device.get("basic") or {})
        if version in BASIC_SHAPE_VERSIONS:
            fields = {k: v for k, v in flat.items() if k != "name"}
            out.append({"name": flat.get("name"), "basic": fields} if fields else {"name": flat.get("name")})
        else:
            out.append(flat)
    return out


def _stored_version(obj: Obj) -> str:
    return str(obj.get("apiVersion", "")).rpartition("/")[2]


def _slice_as(obj: Obj, version: str) -> Obj:
    """A stored slice as served at `version`: apiVersion rewritten, devices in that version's shape."""
    out = copy.deepcopy(obj)
    stored = _stored_version(obj)
    out["apiVersion"] = f"{GROUP}/{version}"
    if (stored in BASIC_SHAPE_VERSIONS) != (version in BASIC_SHAPE_VERSIONS) and "devices" in out["spec"]:
        out["spec"]["devices"] = _devices_in_shape(out["spec"]["devices"], version)
    return out


def _normalized_spec(obj: Obj) -> Obj:
    spec = copy.deepcopy(obj.get("spec", {}))
    spec["devices"] = _devices_in_shape(spec.get("devices", []), "v1")
    return cast(Obj, spec)


def _parse_field_selector(query: dict[str, list[str]]) -> list[tuple[str, bool, str]]:
    """(field, equal, value) terms of fieldSelector; the API server answers 400 for a field it does not index."""
    terms: list[tuple[str, bool, str]] = []
    for selector in query.get("fieldSelector", []):
        for term in filter(None, (t.strip() for t in selector.split(","))):
            match = re.fullmatch(r"([^=!]+?)\s*(==|!=|=)\s*(.*)", term)
            if not match:
                raise _bad_request(f'invalid selector: "{selector}"; unable to parse requirement: "{term}"')
            field, op, value = match.groups()
            if field not in SLICE_FIELD_SELECTORS:
                raise _bad_request(
                    f'"{field}" is not a known field selector: only "{", ".join(SLICE_FIELD_SELECTORS)}"'
                )
            terms.append((field, op != "!=", value))
    return terms


def _slice_field(obj: Obj, field: str) -> str:
    if field == "metadata.name":
        return str(obj["metadata"].get("name", ""))
    return str(obj.get("spec", {}).get(field.removeprefix("spec."), "") or "")


def _with_type_meta(obj: Obj, version: str, kind: str) -> Obj:
    """A deep copy with apiVersion and kind first, as the API server serializes them."""
    rest = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    return copy.deepcopy({"apiVersion": f"{GROUP}/{version}", "kind": kind, **rest})


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _matches(obj: Obj, terms: list[tuple[str, bool, str]]) -> bool:
    return all((_slice_field(obj, field) == value) == equal for field, equal, value in terms)


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return query.get(name, ["false"])[-1].lower() in ("true", "1")


def _dry_run(query: dict[str, list[str]], options_kind: str) -> bool:
    """Whether a write is dryRun=All; another value is refused as the API server validates Create/UpdateOptions."""
    values = query.get("dryRun", [])
    if any(value != "All" for value in values):
        errs = _Errors()
        errs.not_supported("dryRun", values, ("All",))
        errs.raise_if_any(options_kind, "", group="meta.k8s.io")
    return bool(values)


@dataclasses.dataclass(frozen=True)
class _Event:
    """One write of a ResourceSlice as etcd's watch reports it: the object as stored, and before."""

    revision: int
    type: str
    obj: Obj
    prev: Obj | None = None


@dataclasses.dataclass(frozen=True)
class _WatchRequest:
    """A watch's query parameters, checked before its stream begins."""

    version: str
    terms: list[tuple[str, bool, str]]
    # None: the current state as ADDED events, then what follows ("0", or no resourceVersion).
    resource_version: int | None
    bookmarks: bool
    timeout: float | None


@dataclasses.dataclass(eq=False)
class _Watch:
    """A live watch stream: the events due to it, already filtered by its selector (equal only to itself)."""

    request: _WatchRequest
    # Events with a revision above this one are due to the watch.
    after: int
    pending: deque[tuple[str, Obj]] = dataclasses.field(default_factory=deque)
    # Why the stream must end: "clean" (a terminating chunk) or "abort" (the connection cut).
    ended: str | None = None

    def offer(self, event: _Event) -> None:
        """Queue `event` as this watch sees it; an object leaving the selector is DELETED to it."""
        if event.revision <= self.after:
            return
        terms = self.request.terms
        now = _matches(event.obj, terms)
        if event.type == "MODIFIED" and event.prev is not None:
            before = _matches(event.prev, terms)
            if now:
                self.pending.append(("MODIFIED" if before else "ADDED", event.obj))
            elif before:
                gone = copy.deepcopy(event.prev)
                gone["metadata"]["resourceVersion"] = str(event.revision)
                self.pending.append(("DELETED", gone))
            return
        if now:
            self.pending.append((event.type, event.obj))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-apiserver"
    raw_requestline: bytes

    def _api(self) -> FakeApiServer:
        return cast(_Server, self.server).api

    def log_message(self, format: str, *args: Any) -> None:
        # Every request is in FakeApiServer.requests; stderr stays quiet.
        pass

    def handle_one_request(self) -> None:
        # http.server's own, minus its do_<METHOD> lookup: every method reaches _dispatch so
        # that unknown ones get the API server's 405 Status rather than an HTML 501.
        try:
            self.raw_requestline = self.rfile.readline(_MAX_LINE + 1)
            if len(self.raw_requestline) > _MAX_LINE:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            self._dispatch()
            self.wfile.flush()
        except OSError:
            # The client went away, or stop() shut the socket.
            self.close_connection = True

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
        except ValueError:
            size = -1
        if size < 0:
            raise _bad_request(f"invalid Content-Length {length!r}")
        return self.rfile.read(size)

    def _read_chunked(self) -> bytes:
        chunks: list[bytes] = []
        while True:
            line = self.rfile.readline(_MAX_LINE + 1)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise _bad_request("malformed chunked body") from None
            if size == 0:
                while self.rfile.readline(_MAX_LINE + 1) not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(self.rfile.read(size))
            self.rfile.readline(_MAX_LINE + 1)

    def _dispatch(self) -> None:
        api = self._api()
        try:
            body = self._read_body()
        except ApiError as err:
            # The request's framing is lost, so is the connection.
            self.close_connection = True
            status, payload, headers = err.code, err.status(), err.headers
        else:
            answer = api._serve(
                self.command,
                self.path,
                self.headers.get("Authorization"),
                self.headers.get("Content-Type"),
                body,
            )
            if isinstance(answer, _WatchRequest):
                self._stream_watch(api, answer)
                return
            status, payload, headers = answer
        # Recorded before the answer leaves, so a client that has it sees the record.
        api._record(self.command, self.path, status)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _stream_watch(self, api: FakeApiServer, request: _WatchRequest) -> None:
        """A watch's 200 and its events, one JSON object and newline a chunk, until it ends."""
        watch, expired = api._open_watch(request)
        # Recorded once the watch is registered: a test that sees the record sees the watch.
        api._record(self.command, self.path, 200)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if watch is None:
            self._send_event("ERROR", expired or {})
            self.wfile.write(b"0\r\n\r\n")
            return
        try:
            self._watch_loop(api, watch)
        finally:
            api._close_watch(watch)

    def _watch_loop(self, api: FakeApiServer, watch: _Watch) -> None:
        request = watch.request
        started = time.monotonic()
        deadline = started + request.timeout if request.timeout is not None else None
        next_bookmark = started + api.bookmark_seconds if request.bookmarks else None
        while True:
            with api._changed:
                if not watch.pending and watch.ended is None:
                    due = [t for t in (deadline, next_bookmark) if t is not None]
                    wait = min([_WATCH_POLL, *(t - time.monotonic() for t in due)])
                    if wait > 0:
                        api._changed.wait(wait)
                events = list(watch.pending)
                watch.pending.clear()
                ended = watch.ended
                # Every event up to this revision is in `events` or was sent before.
                current = max(api._revision, watch.after)
            if ended == "abort":
                self.close_connection = True
                return
            for kind, obj in events:
                self._send_event(kind, _slice_as(obj, request.version))
            if ended is not None:
                # An API server going away ends its watches and the connections under them.
                self.close_connection = True
                self.wfile.write(b"0\r\n\r\n")
                return
            now = time.monotonic()
            if next_bookmark is not None and now >= next_bookmark:
                self._send_event(
                    "BOOKMARK",
                    {
                        "kind": "ResourceSlice",
                        "apiVersion": f"{GROUP}/{request.version}",
                        "metadata": {"resourceVersion": str(current)},
                    },
                )
                next_bookmark = now + api.bookmark_seconds
            if deadline is not None and now >= deadline:
                # timeoutSeconds: the body ends and the connection stays, as the API server's do.
                self.wfile.write(b"0\r\n\r\n")
                return
            if not events and self._client_gone():
                self.close_connection = True
                return

    def _send_event(self, kind: str, obj: Obj) -> None:
        data = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """Whether the watch's client closed its end: a watch client sends nothing while it reads."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


class _Server(ThreadingHTTPServer):
    """One daemon thread per connection, each tracked so that stop() can shut idle keep-alive sockets."""

    daemon_threads = True
    block_on_close = False
    # socketserver's backlog of 5 drops bursts of clients into a 1 s SYN retry.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], api: FakeApiServer) -> None:
        self.api = api
        self._conn_lock = threading.Lock()
        self._conns: dict[socket.socket | tuple[bytes, socket.socket], threading.Thread] = {}
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN, which stalls where DNS is missing.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def process_request(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        thread = threading.Thread(
            target=self.process_request_thread,
            args=(request, client_address),
            name="fake-apiserver-conn",
            daemon=True,
        )
        with self._conn_lock:
            self._conns[request] = thread
        thread.start()

    def shutdown_request(self, request: socket.socket | tuple[bytes, socket.socket]) -> None:
        with self._conn_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        # A client gone or a socket shut by close_connections() is expected, not a fault.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)

    def close_connections(self, timeout: float) -> None:
        with self._conn_lock:
            conns = list(self._conns.items())
        for request, _ in conns:
            sock = request if isinstance(request, socket.socket) else request[1]
            # Wakes the handler blocked reading the next request; its thread then closes the socket.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))


class FakeApiServer:
    """The API server of a cluster with the resource.k8s.io group served at `versions`, the first preferred."""

    def __init__(
        self,
        versions: tuple[str, ...] = ("v1",),
        token: str | None = "test-token",
        port: int = 0,
        *,
        taints: bool = True,
        netns: NetNamespace | None = None,
        users: Mapping[str, User] | None = None,
    ) -> None:
        if not versions or len(set(versions)) != len(versions):
            raise ValueError(f"versions must be distinct and not empty: {versions!r}")
        unknown = set(versions) - BASIC_SHAPE_VERSIONS - FLAT_SHAPE_VERSIONS
        if unknown:
            raise ValueError(f"unsupported {GROUP} versions: {sorted(unknown)}")
        self.versions = tuple(versions)
        self.token = token
        # Other users by token: a node's kubelet (`system:node:<name>`, held to the Node authorizer's and
        # NodeRestriction's rules), or a user the loaded admission policies judge. `token` is a cluster admin's.
        self.users = dict(users or {})
        self.admission = AdmissionPolicies()
        # Pods bound to nodes, (namespace, name) -> node: what lets a node read the claims they reference.
        self._pods: dict[tuple[str, str], str] = {}
        # The DRADeviceTaints gate; a test may flip it between requests.
        self.taints = taints
        # Whether a taint may have the effect None (1.35 on); False refuses it, as 1.33 and 1.34 do.
        self.effect_none = True
        self._port = port
        # Where 127.0.0.1 is the daemon's: a simulated node's network namespace, or this process's.
        self._netns = netns
        self._lock = threading.Lock()
        # Signalled, under _lock, at every event for the watches and when they must end.
        self._changed = threading.Condition(self._lock)
        self._life_lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._rng = random.Random()
        self._slices: dict[str, Obj] = {}
        self._claims: dict[tuple[str, str], Obj] = {}
        self._revision = 0
        self._history: deque[_Event] = deque()
        # A watch from a resourceVersion below this one has lost events: 410 Gone.
        self._compacted = 0
        self._watches: list[_Watch] = []
        self.bookmark_seconds = BOOKMARK_SECONDS
        self.history_limit = WATCH_HISTORY
        self._fail_count = 0
        self._fail_status = 500
        self._fail_reason = "InternalError"
        self._fail_writes_only = False
        self.requests: list[tuple[str, str, int]] = []
        # Every stored write of a slice as it landed: (time.monotonic(), event type, slice name, device names).
        self.timeline: list[tuple[float, str, str, tuple[str, ...]]] = []

    # Lifecycle.

    @property
    def port(self) -> int:
        if self._port == 0:
            raise RuntimeError("FakeApiServer not started yet: port 0 is picked on start()")
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        with self._life_lock:
            if self._server is not None:
                raise RuntimeError("FakeApiServer already started")
            address = ("127.0.0.1", self._port)
            server = self._netns.run(lambda: _Server(address, self)) if self._netns else _Server(address, self)
            self._port = int(server.server_address[1])
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"fake-apiserver-{self._port}",
                daemon=True,
            )
            thread.start()
            self._server, self._thread = server, thread

    def stop(self) -> None:
        with self._life_lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        self._end_watches("abort")
        server.close_connections(timeout=5.0)
        if thread is not None:
            thread.join(5.0)

    def restart(self, keep_state: bool = True) -> None:
        self.stop()
        if not keep_state:
            with self._lock:
                self._slices.clear()
                self._claims.clear()
                self._revision = 0
                self._history.clear()
                self._compacted = 0
        self.start()

    def __enter__(self) -> FakeApiServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, token: str | None = None) -> Path:
        """A kubeconfig for this server with a bearer token: the server's unless another is given."""
        token = self.token if token is None else token
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake-apiserver", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-apiserver", "user": {"token": token} if token is not None else {}}],
            "contexts": [
                {"name": "fake-apiserver", "context": {"cluster": "fake-apiserver", "user": "fake-apiserver"}}
            ],
            "current-context": "fake-apiserver",
            "preferences": {},
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    # State, for tests.

    def slices(self, node: str | None = None, driver: str | None = None) -> list[Obj]:
        with self._lock:
            found = [
                copy.deepcopy(obj)
                for obj in self._slices.values()
                if (node is None or obj["spec"].get("nodeName") == node)
                and (driver is None or obj["spec"].get("driver") == driver)
            ]
        return sorted(found, key=lambda obj: str(obj["metadata"]["name"]))

    def bind_pod(self, namespace: str, name: str, node: str) -> None:
        """A pod scheduled to `node`: a claim whose status.reservedFor names it becomes readable by that node."""
        with self._lock:
            self._pods[(namespace, name)] = node

    def add_claim(self, claim: Obj) -> None:
        stored = copy.deepcopy(claim)
        meta = stored.setdefault("metadata", {})
        if not meta.get("name"):
            raise ValueError("a ResourceClaim needs metadata.name")
        meta.setdefault("namespace", "default")
        stored.setdefault("apiVersion", f"{GROUP}/{self.versions[0]}")
        stored.setdefault("kind", "ResourceClaim")
        with self._lock:
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            meta["resourceVersion"] = self._next_revision()
            self._claims[(meta["namespace"], meta["name"])] = stored

    def delete_claim(self, namespace: str, name: str) -> None:
        with self._lock:
            if self._claims.pop((namespace, name), None) is None:
                raise KeyError(f"no ResourceClaim {namespace}/{name}")
            self._next_revision()

    def edit_slice(self, name: str, change: Callable[[Obj], None]) -> Obj:
        """An admin's `kubectl edit`: the stored slice as served in its stored version, changed in place, PUT back.

        Written as a PUT is (validation, dropped gated-off fields, timeAdded, a new resourceVersion,
        MODIFIED); raises the ApiError that PUT would answer, KeyError for no such slice.
        """
        with self._lock:
            old = self._slices.get(name)
            if old is None:
                raise KeyError(f"no ResourceSlice {name}")
            version = _stored_version(old)
            edited = _slice_as(old, version)
        change(edited)
        return self._replace_slice(version, name, edited)

    def delete_slices(self, node: str) -> int:
        with self._lock:
            doomed = [name for name, obj in self._slices.items() if obj["spec"].get("nodeName") == node]
            for name in doomed:
                self._remove_slice(name)
        return len(doomed)

    @property
    def watchers(self) -> int:
        """How many watch streams are live now."""
        with self._lock:
            return len(self._watches)

    def compact(self) -> None:
        """Forget every event up to now, as etcd's compaction does: a watch from an older resourceVersion gets 410."""
        with self._lock:
            self._history.clear()
            self._compacted = self._revision

    def end_watches(self, clean: bool = True) -> int:
        """End every live watch now, as an API server restart or a load balancer would; returns how many.

        Clean: the chunked body is ended and the connection closed. Otherwise the connection is cut
        mid-body, with no terminating chunk.
        """
        return self._end_watches("clean" if clean else "abort")

    def fail_next(
        self, count: int, status: int = 500, reason: str = "InternalError", *, writes_only: bool = False
    ) -> None:
        """The next `count` requests (with `writes_only`: POST, PUT and DELETE only) fail so."""
        if count < 0:
            raise ValueError("count must not be negative")
        with self._lock:
            self._fail_count, self._fail_status, self._fail_reason = count, status, reason
            self._fail_writes_only = writes_only

    # HTTP.

    def _record(self, method: str, target: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, target, status))

    def _next_revision(self) -> str:
        # Callers hold self._lock; like etcd's, one counter for every write.
        self._revision += 1
        return str(self._revision)

    # Watch.

    def _emit(self, kind: str, obj: Obj, prev: Obj | None = None) -> None:
        """Record a slice's write in the history and hand it to every live watch (callers hold _lock)."""
        event = _Event(int(obj["metadata"]["resourceVersion"]), kind, copy.deepcopy(obj), copy.deepcopy(prev))
        names = tuple(str(d.get("name")) for d in (obj.get("spec") or {}).get("devices") or [])
        self.timeline.append((time.monotonic(), kind, str(obj["metadata"]["name"]), names))
        self._history.append(event)
        while len(self._history) > max(1, self.history_limit):
            self._compacted = self._history.popleft().revision
        for watch in self._watches:
            watch.offer(event)
        self._changed.notify_all()

    def _remove_slice(self, name: str) -> Obj:
        """Delete a stored slice; DELETED carries its last state at the deletion's revision (callers hold _lock)."""
        old = self._slices.pop(name)
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = self._next_revision()
        self._emit("DELETED", gone)
        return old

    def _watch_request(self, version: str, query: dict[str, list[str]]) -> _WatchRequest:
        terms = _parse_field_selector(query)
        raw_version = query.get("resourceVersion", [""])[-1]
        if raw_version not in ("", "0") and not raw_version.isdigit():
            raise _bad_request(
                f'resourceVersion: Invalid value: "{raw_version}": strconv.ParseUint: parsing "{raw_version}": '
                "invalid syntax"
            )
        raw_timeout = query.get("timeoutSeconds", [""])[-1]
        try:
            timeout = int(raw_timeout) if raw_timeout else 0
        except ValueError:
            raise _bad_request(f'timeoutSeconds: Invalid value: "{raw_timeout}": must be an integer') from None
        return _WatchRequest(
            version=version,
            terms=terms,
            resource_version=int(raw_version) if raw_version not in ("", "0") else None,
            bookmarks=_flag(query, "allowWatchBookmarks"),
            # 0 (or none) leaves the stream open: the real server then picks its own long timeout.
            timeout=float(timeout) if timeout > 0 else None,
        )

    def _open_watch(self, request: _WatchRequest) -> tuple[_Watch | None, Obj | None]:
        """Register a watch with the events already due to it, or the 410 Status when its start is compacted."""
        with self._lock:
            start = request.resource_version
            if start is None:
                watch = _Watch(request, after=self._revision)
                watch.pending.extend(
                    ("ADDED", copy.deepcopy(obj))
                    for obj in sorted(self._slices.values(), key=lambda o: str(o["metadata"]["name"]))
                    if _matches(obj, request.terms)
                )
            elif start < self._compacted:
                message = f"too old resource version: {start} ({self._compacted})"
                return None, ApiError(410, "Expired", message).status()
            else:
                watch = _Watch(request, after=start)
                for event in self._history:
                    watch.offer(event)
            self._watches.append(watch)
            return watch, None

    def _close_watch(self, watch: _Watch) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)

    def _end_watches(self, how: str) -> int:
        with self._lock:
            live = [w for w in self._watches if w.ended is None]
            for watch in live:
                watch.ended = how
            self._changed.notify_all()
        return len(live)

    def _serve(
        self, method: str, target: str, authorization: str | None, content_type: str | None, body: bytes
    ) -> tuple[int, Obj, dict[str, str]] | _WatchRequest:
        try:
            self._take_injected_failure(method)
            user = self._authenticate(authorization)
            if method not in METHODS:
                raise _method_not_allowed()
            if user is not None:
                if user.node is not None:
                    self._authorize_node(user.node, method, target, content_type, body)
                self._admit(user, method, target, content_type, body)
            return self._route(method, target, content_type, body)
        except ApiError as err:
            return err.code, err.status(), err.headers
        except Exception as exc:
            # A bug in the stand-in: answered as the API server would, and shown on stderr.
            traceback.print_exc()
            return 500, ApiError(500, "InternalError", f"fake apiserver: {exc!r}").status(), {}

    def _take_injected_failure(self, method: str) -> None:
        with self._lock:
            if self._fail_count <= 0 or (self._fail_writes_only and method == "GET"):
                return
            self._fail_count -= 1
            status, reason = self._fail_status, self._fail_reason
        headers = {"Retry-After": "1"} if status in (429, 503) else {}
        details: Obj = {"retryAfterSeconds": 1} if headers else {}
        raise ApiError(status, reason, f"injected failure: {reason}", details, headers)

    def _authenticate(self, authorization: str | None) -> User | None:
        """Who the request comes from; None: the cluster admin (or anyone, where no token is asked for)."""
        scheme, _, credential = (authorization or "").strip().partition(" ")
        given = credential.strip().encode() if scheme.lower() == "bearer" else b""
        for token, user in list(self.users.items()):
            if hmac.compare_digest(given, token.encode()):
                return user
        if self.token is None or hmac.compare_digest(given, self.token.encode()):
            return None
        raise ApiError(401, "Unauthorized", "Unauthorized")

    def _admit(self, user: User, method: str, target: str, content_type: str | None, body: bytes) -> None:
        """The loaded ValidatingAdmissionPolicies on a write of a slice (a dry run is admitted alike)."""
        segments = [unquote(s) for s in urlsplit(target).path.split("/")[1:]]
        match segments:
            case ["apis", "resource.k8s.io", _, "resourceslices"] if method == "POST":
                operation, new, old = "CREATE", self._decode(content_type, body), None
            case ["apis", "resource.k8s.io", _, "resourceslices", name] if method in ("PUT", "DELETE"):
                with self._lock:
                    old = copy.deepcopy(self._slices.get(name))
                if old is None:
                    return  # not found: the route says so
                operation = "UPDATE" if method == "PUT" else "DELETE"
                new = self._decode(content_type, body) if method == "PUT" else None
            case _:
                return
        denied = self.admission.check(user, GROUP, "resourceslices", operation, new, old)
        if denied is not None:
            name = str(((new or old or {}).get("metadata") or {}).get("name") or "")
            raise ApiError(
                422,
                "Invalid",
                f"resourceslices.{GROUP} \"{name}\" is forbidden: ValidatingAdmissionPolicy '{denied.policy}' with "
                f"binding '{denied.policy}' denied request: {denied.message}",
                {"group": GROUP, "kind": "resourceslices", "name": name},
            )

    def _authorize_node(self, node: str, method: str, target: str, content_type: str | None, body: bytes) -> None:
        """What the Node authorizer and NodeRestriction let `system:node:<node>` do with slices and claims."""
        user = f"system:node:{node}"
        parts = urlsplit(target)
        segments = [unquote(s) for s in parts.path.split("/")[1:]]
        query = parse_qs(parts.query, keep_blank_values=True)
        verb = {"GET": "watch" if _flag(query, "watch") else "get", "POST": "create", "PUT": "update"}.get(method, "")
        verb = verb or ("delete" if method == "DELETE" else method.lower())

        def forbidden(resource: str, why: str, name: str = "") -> ApiError:
            what = f'{resource} "{name}" is forbidden: ' if name else ""
            message = f'{what}User "{user}" cannot {verb} resource "{resource}" in API group "{GROUP}": {why}'
            return ApiError(403, "Forbidden", message, {"group": GROUP, "kind": resource, "name": name})

        match segments:
            case ["apis"] | ["apis", "resource.k8s.io"] | ["apis", "resource.k8s.io", _]:
                return  # discovery: every authenticated user
            case ["apis", "resource.k8s.io", _, "resourceslices"] if method in ("GET", "DELETE"):
                verb = verb if method == "DELETE" or verb == "watch" else "list"
                terms = _parse_field_selector(query)
                if ("spec.nodeName", True, node) not in terms:
                    raise forbidden("resourceslices", "can only list/watch ResourceSlices with nodeName field selector")
            case ["apis", "resource.k8s.io", _, "resourceslices"] if method == "POST":
                new = self._decode(content_type, body)
                if (new.get("spec") or {}).get("nodeName") != node:
                    name = str((new.get("metadata") or {}).get("name") or "")
                    raise forbidden("resourceslices", "can only create ResourceSlices of its own node", name)
            case ["apis", "resource.k8s.io", _, "resourceslices", name] if method in ("PUT", "DELETE"):
                with self._lock:
                    old = self._slices.get(name)
                new = self._decode(content_type, body) if method == "PUT" else {}
                for obj in (old, new if method == "PUT" else None):
                    if obj is not None and (obj.get("spec") or {}).get("nodeName") != node:
                        raise forbidden("resourceslices", "can only change ResourceSlices of its own node", name)
            case ["apis", "resource.k8s.io", _, "namespaces", namespace, "resourceclaims", name] if method == "GET":
                with self._lock:
                    claim = self._claims.get((namespace, name)) or {}
                    pods = {n for (ns, n), bound in self._pods.items() if ns == namespace and bound == node}
                reserved = (claim.get("status") or {}).get("reservedFor") or []
                if not any(r.get("resource") == "pods" and r.get("name") in pods for r in reserved):
                    raise ApiError(
                        403,
                        "Forbidden",
                        f'resourceclaims.{GROUP} "{name}" is forbidden: User "{user}" cannot get resource '
                        f'"resourceclaims" in API group "{GROUP}" in the namespace "{namespace}": no relationship '
                        "found between node and this object",
                        {"group": GROUP, "kind": "resourceclaims", "name": name},
                    )
            case _:
                raise forbidden(segments[-1] if segments else "", "not allowed to a node")

    def _route(
        self, method: str, target: str, content_type: str | None, body: bytes
    ) -> tuple[int, Obj, dict[str, str]] | _WatchRequest:
        parts = urlsplit(target)
        segments = [unquote(s) for s in parts.path.split("/")[1:]] if parts.path.startswith("/") else []
        query = parse_qs(parts.query, keep_blank_values=True)

        def only(allowed: str, answer: Callable[[], Obj]) -> tuple[int, Obj, dict[str, str]]:
            if method != allowed:
                raise _method_not_allowed()
            return 200, answer(), {}

        match segments:
            case ["apis"]:
                return only("GET", lambda: {"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group()]})
            case ["apis", "resource.k8s.io"]:
                return only("GET", self._group)
            case ["apis", "resource.k8s.io", version] if version in self.versions:
                return only("GET", lambda: self._resources(version))
            case ["apis", "resource.k8s.io", version, "resourceslices"] if version in self.versions:
                if method == "GET" and _flag(query, "watch"):
                    return self._watch_request(version, query)
                if method == "GET":
                    return 200, self._list_slices(version, query), {}
                if method == "POST":
                    dry_run = _dry_run(query, "CreateOptions")
                    return 201, self._create_slice(version, self._decode(content_type, body), dry_run), {}
                if method == "DELETE":
                    return 200, self._delete_slice_collection(version, query), {}
                raise _method_not_allowed()
            case ["apis", "resource.k8s.io", version, "resourceslices", name] if version in self.versions:
                if method == "GET":
                    return 200, self._get_slice(version, name), {}
                if method == "PUT":
                    dry_run = _dry_run(query, "UpdateOptions")
                    return 200, self._replace_slice(version, name, self._decode(content_type, body), dry_run), {}
                if method == "DELETE":
                    options = self._decode(content_type, body) if body.strip() else {}
                    return 200, self._delete_slice(name, options), {}
                raise _method_not_allowed()
            case ["apis", "resource.k8s.io", version, "namespaces", namespace, "resourceclaims", name] if (
                version in self.versions
            ):
                return only("GET", lambda: self._get_claim(version, namespace, name))
            case _:
                raise _not_found_path()

    @staticmethod
    def _decode(content_type: str | None, body: bytes) -> Obj:
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format ({media_type or 'no Content-Type'}) - "
                "accepted media types include: application/json",
            )
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad_request(f"the body of the request could not be decoded as JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise _bad_request("the body of the request must be a JSON object")
        if not isinstance(obj.get("metadata", {}), dict):
            raise _bad_request("metadata must be an object")
        return obj

    def _group(self) -> Obj:
        versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in self.versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": GROUP,
            "versions": versions,
            "preferredVersion": dict(versions[0]),
        }

    def _resources(self, version: str) -> Obj:
        verbs = ["create", "delete", "deletecollection", "get", "list", "update", "watch"]
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{GROUP}/{version}",
            "resources": [
                {
                    "name": "resourceslices",
                    "singularName": "resourceslice",
                    "namespaced": False,
                    "kind": "ResourceSlice",
                    "verbs": verbs,
                },
                {
                    "name": "resourceclaims",
                    "singularName": "resourceclaim",
                    "namespaced": True,
                    "kind": "ResourceClaim",
                    "verbs": ["get"],
                },
            ],
        }

    @staticmethod
    def _check_type_meta(obj: Obj, version: str, kind: str) -> None:
        # Absent apiVersion and kind default from the URL, as the API server's decoder does.
        api_version = obj.get("apiVersion")
        if api_version is not None and api_version != f"{GROUP}/{version}":
            raise _bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version "
                f"({GROUP}/{version})"
            )
        obj_kind = obj.get("kind")
        if obj_kind is not None and obj_kind != kind:
            raise _bad_request(f"the kind in the data ({obj_kind}) does not match the expected kind ({kind})")

    def _select(self, query: dict[str, list[str]]) -> list[Obj]:
        # Callers hold self._lock.
        terms = _parse_field_selector(query)
        found = [obj for obj in self._slices.values() if _matches(obj, terms)]
        return sorted(found, key=lambda obj: str(obj["metadata"]["name"]))

    def _slice_list(self, version: str, items: list[Obj]) -> Obj:
        # Callers hold self._lock. Items of a list carry no apiVersion or kind, as the API server sends them.
        served = []
        for obj in items:
            item = _slice_as(obj, version)
            item.pop("apiVersion", None)
            item.pop("kind", None)
            served.append(item)
        return {
            "kind": "ResourceSliceList",
            "apiVersion": f"{GROUP}/{version}",
            "metadata": {"resourceVersion": str(self._revision)},
            "items": served,
        }

    def _list_slices(self, version: str, query: dict[str, list[str]]) -> Obj:
        with self._lock:
            return self._slice_list(version, self._select(query))

    def _get_slice(self, version: str, name: str) -> Obj:
        with self._lock:
            obj = self._slices.get(name)
            if obj is None:
                raise _object_error(404, "NotFound", "resourceslices", name, "not found")
            return _slice_as(obj, version)

    def _create_slice(self, version: str, obj: Obj, dry_run: bool = False) -> Obj:
        self._check_type_meta(obj, version, "ResourceSlice")
        meta: Obj = obj.setdefault("metadata", {})
        if meta.get("resourceVersion"):
            raise ApiError(500, "InternalError", "resourceVersion should not be set on objects to be created")
        name = meta.get("name")
        generate = meta.get("generateName")
        errs = _Errors()
        if not name and not generate:
            errs.required("metadata.name", "name or generateName is required")
        elif name and (not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name)):
            errs.invalid("metadata.name", name, "must be a DNS subdomain")
        elif not name and (not isinstance(generate, str) or not _DNS_SUBDOMAIN.match(generate + "x")):
            errs.invalid("metadata.generateName", generate, "must be a DNS subdomain prefix")
        _prepare_slice(obj, keep_taints=self.taints, now=_now())
        if not self.effect_none:
            _refuse_effect_none(obj, errs)
        _validate_slice_spec(obj.get("spec"), version, errs)
        errs.raise_if_any("ResourceSlice", str(name or generate or ""))

        with self._lock:
            name = str(name or self._generated_name(str(generate)))
            # A dry run is refused for a taken name too: it is checked against storage.
            if name in self._slices:
                raise _object_error(409, "AlreadyExists", "resourceslices", name, "already exists")
            meta.update(name=name, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            return self._write(version, obj, "ADDED", None, dry_run)

    def _generated_name(self, generate: str) -> str:
        # Callers hold self._lock.
        prefix = generate[:_MAX_GENERATE_NAME_PREFIX]
        name = prefix
        for _ in range(10):
            name = prefix + "".join(self._rng.choice(_NAME_ALPHABET) for _ in range(_GENERATED_SUFFIX))
            if name not in self._slices:
                break
        return name

    def _replace_slice(self, version: str, name: str, obj: Obj, dry_run: bool = False) -> Obj:
        """PUT: also the write of edit_slice()."""
        self._check_type_meta(obj, version, "ResourceSlice")
        meta: Obj = obj.setdefault("metadata", {})
        if meta.get("name") != name:
            raise _bad_request(
                f"the name of the object ({meta.get('name') or ''}) does not match the name on the URL ({name})"
            )
        with self._lock:
            old = self._slices.get(name)
            if old is None:
                raise _object_error(404, "NotFound", "resourceslices", name, "not found")
            old_meta = old["metadata"]
            if meta.get("resourceVersion") != old_meta["resourceVersion"]:
                raise _conflict(
                    name, "the object has been modified; please apply your changes to the latest version and try again"
                )
            changed = self._prepare_update(version, name, obj, old)
            meta.update(
                uid=old_meta["uid"],
                creationTimestamp=old_meta["creationTimestamp"],
                generation=old_meta.get("generation", 1) + (1 if changed else 0),
            )
            # Every update bumps the resourceVersion, and so is an event, changed or not.
            return self._write(version, obj, "MODIFIED", old, dry_run)

    def _prepare_update(self, version: str, name: str, obj: Obj, old: Obj) -> bool:
        """Prepare and validate `obj` to replace `old`; whether its spec changed (callers hold _lock)."""
        # Compared as sent, before taints are dropped or timed, as the API server's PrepareForUpdate does.
        sent = {"spec": copy.deepcopy(obj.get("spec"))}
        # With the gate off, a slice that already has taints keeps them (the API server's "in use" rule).
        _prepare_slice(obj, keep_taints=self.taints or _has_taints(old), now=_now())
        errs = _Errors()
        if not self.effect_none:
            _refuse_effect_none(obj, errs)
        spec = obj.get("spec")
        _validate_slice_spec(spec, version, errs)
        if isinstance(spec, dict):
            for field in ("driver", "nodeName"):
                if spec.get(field) != old["spec"].get(field):
                    errs.invalid(f"spec.{field}", spec.get(field), "field is immutable")
        errs.raise_if_any("ResourceSlice", name)
        return _normalized_spec(sent) != _normalized_spec(old)

    def _write(self, version: str, obj: Obj, kind: str, old: Obj | None, dry_run: bool) -> Obj:
        """Store a checked slice and emit its event; a dry run only answers what would be stored (under _lock)."""
        if not dry_run:
            obj["metadata"]["resourceVersion"] = self._next_revision()
        stored = _with_type_meta(obj, version, "ResourceSlice")
        if dry_run:
            return stored
        self._slices[stored["metadata"]["name"]] = stored
        self._emit(kind, stored, old)
        return copy.deepcopy(stored)

    def _delete_slice(self, name: str, options: Obj) -> Obj:
        preconditions = options.get("preconditions") or {}
        with self._lock:
            old = self._slices.get(name)
            if old is None:
                raise _object_error(404, "NotFound", "resourceslices", name, "not found")
            old_meta = old["metadata"]
            for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                wanted = preconditions.get(key)
                if wanted is not None and wanted != old_meta[key]:
                    raise _conflict(
                        name,
                        f"Precondition failed: {label} in precondition: {wanted}, "
                        f"{label} in object meta: {old_meta[key]}",
                    )
            self._remove_slice(name)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {"name": name, "group": GROUP, "kind": "resourceslices", "uid": old_meta["uid"]},
        }

    def _delete_slice_collection(self, version: str, query: dict[str, list[str]]) -> Obj:
        with self._lock:
            doomed = self._select(query)
            for obj in doomed:
                self._remove_slice(obj["metadata"]["name"])
            return self._slice_list(version, doomed)

    def _get_claim(self, version: str, namespace: str, name: str) -> Obj:
        with self._lock:
            claim = self._claims.get((namespace, name))
            if claim is None:
                raise _object_error(404, "NotFound", "resourceclaims", name, "not found")
            out = copy.deepcopy(claim)
        out["apiVersion"] = f"{GROUP}/{version}"
        return out
