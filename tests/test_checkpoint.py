"""Checkpoints: the envelope both checkpoint files share, the formats from before it, and the health
state file's saver thread (coalesced, in order, off the loop, flushed at close)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from nvplug.base.checkpoint import (
    Checkpoint,
    CheckpointError,
    canonical,
    checksum,
    read_checkpoint,
    seal,
    unseal,
    write_checkpoint,
)
from nvplug.core.health import Clears, Fault, Health, HealthState, Recorded
from nvplug.dra import claims
from nvplug.dra.claims import ClaimRef, ClaimStore, PreparedClaim, PreparedDevice
from nvplug.sinks import health_state_file
from nvplug.sinks.health_state_file import WRITE_INTERVAL, Saved, StateFile, decode, encode

UUID = "GPU-00000000"
BUS = "0000:18:00.0"
FAULT = HealthState(
    Health.UNHEALTHY, "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)", 5.5, Clears.RESET, "udev", 2, "12",
    fault=Fault.XID, xid=79,
)  # fmt: skip
CLAIM = PreparedClaim(
    ClaimRef("ns", "claim-a", "a"),
    (PreparedDevice(("gpus",), "node-a", "gpu-000", UUID, ("k8s.device-plugin.nvidia.com/gpu=GPU-00000000",)),),
)

# What nvplug wrote before the envelope, byte for byte.
HEALTH_FORMAT_1 = b"""{
 "format": 1,
 "boot_id": "boot-a",
 "devices": [
  {
   "uuid": "GPU-00000000",
   "bus_id": "0000:18:00.0",
   "reason": "XID 79 GPU_HAS_FALLEN_OFF_THE_BUS (RESTART_BM)",
   "since": 5.5,
   "clears": "reset",
   "evidence": "udev",
   "recovery_action": 2,
   "driver_instance": "12"
  }
 ]
}
"""
CLAIMS_VERSION_1 = b"""{
 "claims": [
  {
   "claim": {
    "name": "claim-a",
    "namespace": "ns",
    "uid": "a"
   },
   "devices": [
    {
     "cdi_ids": [
      "k8s.device-plugin.nvidia.com/gpu=GPU-00000000"
     ],
     "device": "gpu-000",
     "pool": "node-a",
     "requests": [
      "gpus"
     ],
     "uuid": "GPU-00000000"
    }
   ]
  }
 ],
 "version": 1
}
"""


def records(n: int) -> dict[str, Recorded]:
    """n Unhealthy GPUs, told apart by their reasons."""
    return {f"GPU-{i:08d}": Recorded(f"0000:{0x18 + i:02x}:00.0", FAULT) for i in range(n)}


def saved(n: int) -> Saved:
    return Saved(records(n))


def edited(path: Path, **changes: Any) -> None:
    """The file with some fields changed and its checksum left as it was: what a hand edit does."""
    doc = json.loads(path.read_bytes())
    doc.update(changes)
    path.write_text(json.dumps(doc, indent=1))


# --- the envelope --------------------------------------------------------------------------------


def test_a_checkpoint_round_trips_with_its_envelope_beside_the_document(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "x.json"
    data = seal("nvplug.test", 3, {"items": [1, 2.5, "é", None]}, "boot-a")
    assert data == seal("nvplug.test", 3, {"items": [1, 2.5, "é", None]}, "boot-a")  # the same input, the same bytes
    write_checkpoint(path, data)
    assert path.read_bytes() == data and (path.stat().st_mode & 0o777) == 0o600
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    doc = json.loads(data)
    assert list(doc) == ["kind", "version", "boot_id", "sha256", "items"]
    assert len(doc["sha256"]) == 64
    got = read_checkpoint(path, "nvplug.test", 3)
    assert got == Checkpoint("nvplug.test", 3, "boot-a", {"items": [1, 2.5, "é", None]})
    # An older version of the same kind is handed over too: the caller reads got.version.
    assert read_checkpoint(path, "nvplug.test", 4).version == 3
    # Layout is not content: the same document indented otherwise still verifies.
    path.write_text(json.dumps(doc))
    assert read_checkpoint(path, "nvplug.test", 3) == got
    assert canonical({"b": 1, "a": [True]}) == b'{"a":[true],"b":1}'


def test_a_checksum_mismatch_is_refused_and_says_which_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    write_checkpoint(path, seal("nvplug.test", 1, {"items": [1]}, "boot-a"))
    edited(path, items=[2])
    with pytest.raises(CheckpointError, match="checksum mismatch") as caught:
        read_checkpoint(path, "nvplug.test", 1)
    assert caught.value.path == path and str(path) in str(caught.value)
    assert "damaged, or edited by hand" in caught.value.reason
    # The envelope is covered too: a boot id edited by hand does not pass.
    write_checkpoint(path, seal("nvplug.test", 1, {"items": [1]}, "boot-a"))
    edited(path, boot_id="boot-b")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_checkpoint(path, "nvplug.test", 1)
    edited(path, sha256=None)
    with pytest.raises(CheckpointError, match="checksum mismatch: sha256 None recorded"):
        read_checkpoint(path, "nvplug.test", 1)


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        (
            {"kind": "nvplug.test", "version": 2, "boot_id": None},
            r"written by a newer nvplug \(version 2; this one reads up to 1\)",
        ),
        ({"kind": "nvplug.other", "version": 1, "boot_id": None}, "a 'nvplug.other' checkpoint, not 'nvplug.test'"),
        ({"kind": "nvplug.test", "version": "1", "boot_id": None}, "no version number"),
        ({"kind": "nvplug.test", "version": True, "boot_id": None}, "no version number"),
        ({"kind": "nvplug.test", "version": 0, "boot_id": None}, "no version number"),
        ({"items": []}, "no kind: not an nvplug checkpoint"),
    ],
)
def test_a_newer_version_another_kind_or_no_envelope_is_refused(doc: dict[str, Any], why: str) -> None:
    data = json.dumps({**doc, "sha256": "0" * 64}).encode()
    with pytest.raises(CheckpointError, match=why) as caught:
        unseal(data, Path("/state/x.json"), "nvplug.test", 1)
    assert str(caught.value).startswith("/state/x.json: ")


def test_bad_json_and_bad_envelope_fields_are_refused() -> None:
    where = Path("x.json")
    for data, why in [
        (b"{not json", "not JSON: "),
        (b"\xff\xfe\x00", "not JSON: "),
        (b"[]", "not a JSON object"),
        (b'{"kind": "k", "version": 1, "boot_id": NaN, "sha256": "x"}', "not canonical JSON"),
    ]:
        with pytest.raises(CheckpointError, match=why):
            unseal(data, where, "k", 1)
    # A boot id of the wrong type, sealed as such: refused after the checksum passed.
    doc: dict[str, Any] = {"kind": "k", "version": 1, "boot_id": 7}
    doc["sha256"] = checksum(doc)
    with pytest.raises(CheckpointError, match="boot_id is 7"):
        unseal(json.dumps(doc).encode(), where, "k", 1)
    with pytest.raises(ValueError, match="envelope's fields"):
        seal("k", 1, {"version": 9}, None)


def test_a_file_without_the_envelope_goes_to_the_kinds_older_reader() -> None:
    seen: list[dict[str, Any]] = []

    def legacy(doc: dict[str, Any]) -> Checkpoint:
        seen.append(doc)
        if doc.get("v") != 1:
            raise ValueError("not v1")
        return Checkpoint("k", 1, None, {"items": doc["items"]}, sealed=False)

    got = unseal(b'{"v": 1, "items": [3]}', Path("x"), "k", 2, legacy)
    assert got == Checkpoint("k", 1, None, {"items": [3]}, sealed=False) and seen == [{"v": 1, "items": [3]}]
    with pytest.raises(CheckpointError, match=r"^x: not v1$"):
        unseal(b'{"v": 0}', Path("x"), "k", 2, legacy)


# --- the health state file: the envelope and format 1 ---------------------------------------------


def test_the_health_state_file_is_sealed_and_keeps_its_devices_at_the_top(tmp_path: Path) -> None:
    file = StateFile(tmp_path, "boot-a")
    file.save(Saved(records(1)))
    doc = json.loads(file.path.read_bytes())
    assert (doc["kind"], doc["version"], doc["boot_id"]) == ("nvplug.health", health_state_file.FORMAT, "boot-a")
    assert [d["uuid"] for d in doc["devices"]] == [UUID]  # where jq, and operators, look for them
    assert StateFile(tmp_path, "boot-a").load() == records(1)


def test_a_health_state_file_of_format_1_is_still_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # From before faults had a kind: it reads as another fault, without its Xid code.
    old = replace(FAULT, fault=Fault.OTHER, xid=None)
    assert decode(HEALTH_FORMAT_1) == ("boot-a", {UUID: Recorded(BUS, old)})
    (tmp_path / "health.json").write_bytes(HEALTH_FORMAT_1)
    file = StateFile(tmp_path, "boot-a")
    assert file.load() == {UUID: Recorded(BUS, old)}
    assert f"{UUID} ({BUS}) was Unhealthy before this start" in caplog.text
    # The daemon's save at start rewrites it in the envelope, with the same devices.
    file.save(Saved(file.load()))
    assert json.loads(file.path.read_bytes())["kind"] == "nvplug.health"
    assert decode(file.path.read_bytes()) == decode(HEALTH_FORMAT_1)
    caplog.set_level(logging.INFO)
    (tmp_path / "health.json").write_bytes(HEALTH_FORMAT_1)
    assert StateFile(tmp_path, "boot-b").load() == {}
    assert "is from another boot: ignored" in caplog.text


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ({"devices": []}, "ignored: checksum mismatch"),
        ({"version": 3}, "ignored: written by a newer nvplug (version 3; this one reads up to 2)"),
        ({"kind": "nvplug.dra-claims"}, "ignored: a 'nvplug.dra-claims' checkpoint, not 'nvplug.health'"),
        ({"kind": None, "format": 2}, "ignored: a None checkpoint"),
    ],
)
def test_a_damaged_or_foreign_health_state_file_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: dict[str, Any], why: str
) -> None:
    StateFile(tmp_path, "boot-a").save(Saved(records(1)))
    edited(tmp_path / "health.json", **damage)
    assert StateFile(tmp_path, "boot-a").load() == {}
    assert f"health state file {tmp_path / 'health.json'} {why}" in caplog.text


def test_a_format_2_file_without_its_envelope_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "health.json").write_bytes(HEALTH_FORMAT_1.replace(b'"format": 1', b'"format": 2'))
    assert StateFile(tmp_path, "boot-a").load() == {}
    assert "ignored: format 2 without its envelope" in caplog.text


def test_a_dra_checkpoint_in_the_health_state_files_place_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ClaimStore(tmp_path / "health.json", "boot-a")
    store.put(CLAIM)
    assert StateFile(tmp_path, "boot-a").load() == {}
    assert "not 'nvplug.health'" in caplog.text


def test_a_bad_device_in_a_sealed_health_state_file_is_named(tmp_path: Path) -> None:
    data = seal("nvplug.health", 2, {"devices": [{"uuid": 3}]}, "b")
    with pytest.raises(health_state_file.StateFileError, match=r"health\.json: device 0: "):
        decode(data)
    with pytest.raises(CheckpointError, match="devices missing or of the wrong type"):
        decode(seal("nvplug.health", 2, {}, "b"), tmp_path / "h.json")


# --- the DRA claims checkpoint: the envelope and version 1 ---------------------------------------


def test_the_claims_checkpoint_is_sealed_and_records_its_boot(tmp_path: Path) -> None:
    path = tmp_path / claims.CHECKPOINT
    ClaimStore(path, "boot-a").put(CLAIM)
    doc = json.loads(path.read_bytes())
    assert (doc["kind"], doc["version"], doc["boot_id"]) == ("nvplug.dra-claims", claims.CHECKPOINT_VERSION, "boot-a")
    # Valid across a boot, as before the envelope: the kubelet's record of claims outlives it too.
    again = ClaimStore(path, "boot-b")
    again.load()
    assert again.get("a") == CLAIM
    unknown = ClaimStore(path)
    unknown.put(CLAIM)
    assert json.loads(path.read_bytes())["boot_id"] is None


def test_a_claims_checkpoint_of_version_1_is_still_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    path = tmp_path / claims.CHECKPOINT
    path.write_bytes(CLAIMS_VERSION_1)
    store = ClaimStore(path, "boot-a")
    store.load()
    assert list(store) == [CLAIM] and path.read_bytes() == CLAIMS_VERSION_1
    assert f"1 prepared ResourceClaims restored from {path}" in caplog.text
    # The next change writes it in the envelope.
    store.remove("a")
    store.put(CLAIM)
    assert json.loads(path.read_bytes())["kind"] == "nvplug.dra-claims"
    again = ClaimStore(path)
    again.load()
    assert list(again) == [CLAIM]


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ({"claims": []}, "checksum mismatch"),
        ({"version": 3}, "written by a newer nvplug (version 3; this one reads up to 2)"),
        ({"kind": "nvplug.health"}, "a 'nvplug.health' checkpoint, not 'nvplug.dra-claims'"),
    ],
)
def test_a_damaged_or_foreign_claims_checkpoint_is_kept_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Mapping[str, Any], why: str
) -> None:
    path = tmp_path / claims.CHECKPOINT
    ClaimStore(path, "boot-a").put(CLAIM)
    edited(path, **damage)
    content = path.read_bytes()
    store = ClaimStore(path, "boot-a")
    store.load()  # logged, never raised, as before the envelope
    assert len(store) == 0 and not path.exists()
    assert (tmp_path / f"{claims.CHECKPOINT}.bad").read_bytes() == content
    assert f"{path}: unreadable DRA checkpoint ({why}" in caplog.text and f"kept as {path}.bad" in caplog.text


def test_a_health_state_file_in_the_claims_checkpoints_place_is_kept_aside(tmp_path: Path) -> None:
    path = tmp_path / claims.CHECKPOINT
    path.write_bytes(encode(records(1), "boot-a"))
    store = ClaimStore(path)
    store.load()
    assert len(store) == 0 and (tmp_path / f"{claims.CHECKPOINT}.bad").exists()


# --- the health state file's saver ---------------------------------------------------------------


class RecordingStateFile(StateFile):
    """A real state file that notes each write and the thread it ran on, and can hold the first one back."""

    def __init__(self, directory: Path, boot_id: str | None, interval: float = WRITE_INTERVAL) -> None:
        super().__init__(directory, boot_id, interval)
        self.landed: list[tuple[str, dict[str, Recorded]]] = []
        self.longest = 0.0  # the longest save: encoding, writing, fsync
        self.gate = threading.Event()
        self.gate.set()

    def _write(self, data: bytes) -> None:
        assert self.gate.wait(10)
        super()._write(data)
        self.landed.append((threading.current_thread().name, decode(data)[1]))

    def save(self, saved: Saved) -> None:
        began = time.monotonic()
        super().save(saved)
        self.longest = max(self.longest, time.monotonic() - began)


def test_save_soon_makes_one_write_per_loop_turn_with_the_records_at_its_end(tmp_path: Path) -> None:
    file = RecordingStateFile(tmp_path, "boot-a")
    taken: list[str] = []

    async def scenario() -> None:
        current: dict[str, Recorded] = {}

        def take() -> Saved:
            taken.append(threading.current_thread().name)
            return Saved(dict(current))

        file.save_soon(lambda: Saved(records(3)))  # a later call in the turn replaces it
        current.update(records(1))
        file.save_soon(take)
        file.save_soon(take)
        current.update(records(2))  # later in the same turn: still in this write
        assert taken == []  # taken when the turn ends, not now
        await asyncio.sleep(0)
        assert taken == [threading.current_thread().name]  # once, on the loop
        file.close(Saved(records(2)))

    asyncio.run(scenario())
    assert len(file.landed) == 1
    thread, written = file.landed[0]
    assert written == records(2) and thread.startswith("state file")
    assert StateFile(tmp_path, "boot-a").load() == records(2)


async def until(done: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not done in time")


def test_changes_during_a_slow_write_make_one_write_after_it_with_the_latest_records(tmp_path: Path) -> None:
    file = RecordingStateFile(tmp_path, "boot-a")
    file.gate.clear()  # the first write hangs as a slow fsync would

    async def scenario() -> None:
        for n in (1, 2, 3, 4):
            file.save_soon(functools.partial(saved, n))
            await asyncio.sleep(0)  # the loop turns on while the saver waits
        await asyncio.sleep(0.05)
        assert file.landed == []
        file.gate.set()
        await until(lambda: len(file.landed) >= 2)
        await asyncio.sleep(WRITE_INTERVAL * 2)
        assert [len(written) for _, written in file.landed] == [1, 4]  # in order, none skipped at the end
        file.close(Saved(records(4)))

    asyncio.run(scenario())
    assert (file.changes, file.writes) == (4, 2)
    assert all(thread.startswith("state file") for thread, _ in file.landed)
    assert decode(file.path.read_bytes())[1] == records(4)


def test_a_storm_costs_a_write_per_interval_and_the_file_ends_at_the_last_state(tmp_path: Path) -> None:
    """1,000 changes in one second: about 20 writes at 50 ms, each within the lag bound of its change."""
    file = RecordingStateFile(tmp_path, "boot-a")
    lags: list[float] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        current = 0
        told: dict[int, float] = {}

        def take() -> Saved:
            lags.extend(loop.time() - t for n, t in told.items() if n <= current)
            told.clear()
            return saved(current)

        start = loop.time()
        for n in range(1, 1001):
            current = n
            told[n] = loop.time()
            file.save_soon(take)
            await asyncio.sleep(max(0.0, start + n / 1000 - loop.time()))
        await until(lambda: decode(file.path.read_bytes())[1] == records(1000))
        file.close(saved(1000))

    asyncio.run(scenario())
    assert file.changes == 1000
    # Far fewer writes than changes, and some during the storm, not only the last one. How many is the
    # machine's speed: about 20 at 50 ms on a quiet one; fewer when its fsyncs take longer than the interval.
    assert 2 <= file.writes <= 50, file.writes
    # When each change was taken into a write: after the interval, or the write in flight, and a loop
    # turn, which a busy machine makes long: allowed ten intervals, it still tells a change left behind.
    assert max(lags) <= max(WRITE_INTERVAL, file.longest) + 10 * WRITE_INTERVAL, (max(lags), file.longest)
    assert [len(r) for _, r in file.landed] == sorted(len(r) for _, r in file.landed)  # never reordered


def test_written_puts_the_state_of_now_on_disk_without_waiting_for_the_interval(tmp_path: Path) -> None:
    file = RecordingStateFile(tmp_path, "boot-a", interval=60.0)
    state = {"n": 1}
    file.follow(lambda: saved(state["n"]))

    async def scenario() -> None:
        file.save_soon(lambda: saved(state["n"]))
        await asyncio.sleep(0.05)  # written; the next write waits a minute
        state["n"] = 2
        file.save_soon(lambda: saved(state["n"]))
        assert await file.written() is None
        assert decode(file.path.read_bytes())[1] == records(2)
        file.close(saved(2))

    asyncio.run(scenario())
    assert [len(r) for _, r in file.landed] == [1, 2]


def test_close_waits_for_queued_saves_then_writes_the_final_records(tmp_path: Path) -> None:
    file = RecordingStateFile(tmp_path, "boot-a")

    async def scenario() -> None:
        file.save_soon(lambda: Saved(records(1)))
        await asyncio.sleep(0)  # queued on the saver
        file.save_soon(lambda: Saved(records(2)))  # not taken yet: close's records supersede it
        file.close(Saved(records(3)))
        assert decode(file.path.read_bytes())[1] == records(3)
        await asyncio.sleep(0)
        file.close(Saved(records(3)))  # again: nothing changed, nothing written
        # A change after close is still saved, on the loop: no saver is left to wait for it.
        file.save_soon(lambda: Saved(records(4)))
        await asyncio.sleep(0)

    asyncio.run(scenario())
    main = threading.main_thread().name
    assert [(t.startswith("state file"), len(r)) for t, r in file.landed] == [(True, 1), (False, 3), (False, 4)]
    assert {t for t, _ in file.landed[1:]} == {main}
    assert decode(file.path.read_bytes())[1] == records(4)


def test_close_without_a_loop_or_any_save_soon_writes_the_records(tmp_path: Path) -> None:
    file = StateFile(tmp_path / "state", "boot-a")
    file.close(Saved(records(1)))
    file.close(Saved(records(1)))
    assert StateFile(tmp_path / "state", "boot-a").load() == records(1)


def test_written_gives_the_loop_a_turn_when_the_write_in_flight_is_done_but_not_yet_told(tmp_path: Path) -> None:
    """A write's future can be done while its done callback still waits in the loop's queue (the caller's
    step ran in the same turn as the result's arrival). written() must let that callback run, not spin
    on a future that never changes with the loop held: an MPS group's start hung so for good."""
    file = RecordingStateFile(tmp_path, "boot-a", interval=60.0)
    file.follow(lambda: saved(1))
    finished = threading.Event()

    async def scenario() -> None:
        in_flight = asyncio.get_running_loop().create_future()
        in_flight.add_done_callback(file._done)
        file._in_flight = in_flight
        in_flight.set_result(None)  # its callback is queued, not run
        assert await file.written() is None
        assert decode(file.path.read_bytes())[1] == records(1)
        file.close(saved(1))
        finished.set()

    # On a thread of its own: a spinning loop could not be stopped from inside.
    threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True).start()
    assert finished.wait(10), "written() spun on a done write with the loop held"
