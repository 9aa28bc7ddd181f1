"""The sharing prepare sets up, as units: a claim's MPS group from its mpsConfig, the ways of sharing one
device that are refused beside another claim's, and what a failed setup undoes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_dra import NODE, REF, dra_device, uuid

from nvplug.dra.claim_setup import ClaimSetup, claim_group
from nvplug.dra.claim_specs import ClaimSpecs
from nvplug.dra.claims import ClaimError, ClaimRef, ClaimStore, PreparedClaim, PreparedDevice
from nvplug.dra.opaque_config import ClaimMps, ClaimSharing
from nvplug.dra.time_slices import TimeSliceError, TimeSlicer
from nvplug.shaping.mps_groups import MpsGroup


def device(n: int, sharing: ClaimSharing | None) -> PreparedDevice:
    return PreparedDevice(("gpu",), NODE, f"gpu-00{n}", uuid(n), (f"cdi/{n}",), sharing)


def mps(percentage: int | None = None, pinned: int | None = None, per: dict[str, int] | None = None) -> ClaimSharing:
    return ClaimSharing("MPS", mps=ClaimMps(percentage, pinned, per))


def units(*ns: int) -> dict[str, tuple[object, None]]:
    return {uuid(n): (dra_device(n).gpu, None) for n in ns}


def test_a_claims_group_takes_its_limits_per_device_by_index_or_uuid() -> None:
    limits = mps(30, 4096, {"1": 1024, uuid(2): 2048})
    group = claim_group("claim-u", [device(n, limits) for n in (0, 1, 2)], units(0, 1, 2), "claim u")
    assert (group.uuids, group.thread_percentage, group.pinned_mib) == (
        (uuid(0), uuid(1), uuid(2)),
        30,
        (4096, 1024, 2048),
    )
    assert claim_group("g", [device(0, mps())], units(0), "c").thread_percentage == 100
    with pytest.raises(ClaimError, match=r"names '7', neither the index nor the UUID of one of its MPS devices"):
        claim_group("g", [device(0, mps(per={"7": 1}))], units(0), "c")
    with pytest.raises(ClaimError, match="different mpsConfigs; a container talks to one control daemon"):
        claim_group("g", [device(0, mps(10)), device(1, mps(20))], units(0, 1), "c")


class Slicer:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail = fail

    async def set(self, uuid: str, interval: str) -> None:
        self.calls.append((uuid, interval))
        if self.fail and interval != "Default":
            raise TimeSliceError(f"GPU {uuid}: nvidia-smi failed")


class Daemons:
    root = "/run/nvplug/mps"

    def __init__(self, why: str | None = None) -> None:
        self.why = why
        self.started: list[MpsGroup] = []
        self.stopped: list[str] = []

    async def start_claim_group(self, group: MpsGroup) -> str | None:
        self.started.append(group)
        return self.why

    async def stop_claim_group(self, name: str) -> None:
        self.stopped.append(name)


def setup(tmp_path: Path, slicer: Slicer, daemons: Daemons) -> ClaimSetup:
    store = ClaimStore(tmp_path / "dra-claims.json")
    return ClaimSetup(store, ClaimSpecs(tmp_path / "cdi"), slicer, daemons)


def pool(*ns: int) -> dict[str, object]:
    return {f"gpu-00{n}": dra_device(n) for n in ns}


def test_a_daemon_that_does_not_start_fails_the_claim_and_undoes_its_interval(tmp_path: Path) -> None:
    slicer, daemons = Slicer(), Daemons("it exited with status 1")
    s = setup(tmp_path, slicer, daemons)
    claim = PreparedClaim(REF, (device(0, ClaimSharing("TimeSlicing", "Short")), device(1, mps(50))))
    with pytest.raises(ClaimError, match="did not start: it exited with status 1"):
        asyncio.run(s.apply(claim, pool(0, 1)))
    assert slicer.calls == [(uuid(0), "Short"), (uuid(0), "Default")]
    assert s.store.time_slices == {} and not (tmp_path / "cdi").exists()
    assert daemons.stopped == [] and [g.name for g in daemons.started] == [f"claim-{REF.uid}"]
    saved = ClaimStore(tmp_path / "dra-claims.json")
    saved.load()
    assert saved.time_slices == {} and list(saved) == []


def test_a_failing_interval_fails_the_claim_with_nothing_recorded(tmp_path: Path) -> None:
    slicer = Slicer(fail=True)
    s = setup(tmp_path, slicer, Daemons())
    claim = PreparedClaim(REF, (device(0, ClaimSharing("TimeSlicing", "Long")),))
    with pytest.raises(ClaimError, match=r"ResourceClaim .*: GPU .*: nvidia-smi failed"):
        asyncio.run(s.apply(claim, pool(0)))
    # Default is set back too: nvidia-smi may have set the interval before it failed.
    assert slicer.calls == [(uuid(0), "Long"), (uuid(0), "Default")] and s.store.time_slices == {}


def test_refused_shares_name_the_other_claim_and_a_plain_claim_shares_anything(tmp_path: Path) -> None:
    s = setup(tmp_path, Slicer(), Daemons())
    other = PreparedClaim(ClaimRef("ml", "first", "u1"), (device(0, ClaimSharing("TimeSlicing", "Long")),))
    s.store.put(other)
    for sharing, why in [
        (
            ClaimSharing("TimeSlicing", "Short"),
            "the time-slice interval Short is asked for, and it is time-sliced at Long",
        ),
        (mps(), "MPS is asked for, and it is time-sliced"),
    ]:
        with pytest.raises(ClaimError, match=f"device gpu-000 .*: {why} by ResourceClaim ml/first \\(u1\\)"):
            asyncio.run(s.apply(PreparedClaim(REF, (device(0, sharing),)), pool(0)))
    plain = PreparedClaim(REF, (device(0, None),))
    assert asyncio.run(s.apply(plain, pool(0))) == plain
    same = PreparedClaim(REF, (device(0, ClaimSharing("TimeSlicing", "Long")),))
    assert asyncio.run(s.apply(same, pool(0))) == same


def test_the_checkpoint_keeps_each_devices_sharing_and_the_intervals_set(tmp_path: Path) -> None:
    store = ClaimStore(tmp_path / "dra-claims.json")
    devices = (device(0, mps(40, 10240, {"0": 5120})), device(1, ClaimSharing("TimeSlicing", "Medium")))
    claim = PreparedClaim(REF, devices, mps_group="claim-u", cdi_spec="/run/cdi/k8s.gpu.nvidia.com-claim_u.json")
    store.put(claim)
    store.record_time_slice(uuid(1), "Medium")
    again = ClaimStore(tmp_path / "dra-claims.json")
    again.load()
    assert again.get(REF.uid) == claim and again.time_slices == {uuid(1): "Medium"}


def test_an_nvidia_smi_that_cannot_run_is_a_time_slice_error_naming_the_gpu(tmp_path: Path) -> None:
    # Unprepare catches TimeSliceError (the record stays, retried at the next start): an OSError would escape it.
    broken = tmp_path / "nvidia-smi"
    broken.write_bytes(b"\x7fELF not really\n")
    broken.chmod(0o755)
    with pytest.raises(TimeSliceError, match=rf"GPU {uuid(0)}: nvidia-smi compute-policy .* cannot run: .*format"):
        asyncio.run(TimeSlicer(str(broken)).set(uuid(0), "Short"))
