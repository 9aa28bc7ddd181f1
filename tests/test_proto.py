"""The committed gRPC code is what the proto generates, and the wire numbers are the kubelet's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nvplug.protos import deviceplugin_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_not_stale() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def field_numbers(message: type) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]


def test_field_numbers_match_the_kubelet_contract() -> None:
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert field_numbers(pb.RegisterRequest) == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert field_numbers(pb.DevicePluginOptions) == {
        "pre_start_required": 1,
        "get_preferred_allocation_available": 2,
    }
    assert field_numbers(pb.Device) == {"ID": 1, "health": 2, "topology": 3}
    assert field_numbers(pb.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    }
    assert field_numbers(pb.ContainerAllocateResponse) == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert field_numbers(pb.DeviceSpec) == {"container_path": 1, "host_path": 2, "permissions": 3}
    assert field_numbers(pb.Mount) == {"container_path": 1, "host_path": 2, "read_only": 3}
    services = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert services == {
        "Registration": ["Register"],
        "DevicePlugin": [
            "GetDevicePluginOptions",
            "ListAndWatch",
            "GetPreferredAllocation",
            "Allocate",
            "PreStartContainer",
        ],
    }
