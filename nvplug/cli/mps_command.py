"""`nvplug mps prepare|cleanup|stop`: the MPS root's tmpfs, and the teardown of the control daemons.

nvplug-mps.service runs prepare and cleanup around nvplug.service, in the host's mount namespace: a
tmpfs the sandboxed daemon mounted would live in its unit's own, where no container's /dev/shm
could reach it. Without MPS in the config (sharing.mps, or nvplug.dra, whose claims may ask for it),
prepare does nothing; cleanup removes what is there.

stop is the teardown a stop of nvplug is not: the control daemons it recorded quit, and their GPUs get
back the compute modes the health state file recorded. Run with nvplug stopped (else it starts them
again), by an operator or by the package's removal.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from nvplug import config
from nvplug.base.checkpoint import CheckpointError
from nvplug.mps.daemon_records import DaemonRecords
from nvplug.mps.leftover_daemon import LeftoverDaemon
from nvplug.mps.mps_dirs import MpsDirError, RootLayout
from nvplug.nvml.nvml_errors import NvmlUnavailable
from nvplug.pods.process_places import ProcessPlaces
from nvplug.shaping.mps_groups import LOG
from nvplug.sinks.health_state_file import FILE_NAME, StateFile, decode_all, state_dir
from nvplug.sources.nvml_discovery import Nvml
from nvplug.status import status_client


def _layout(args: argparse.Namespace, always: bool = False) -> RootLayout | None:
    try:
        cfg = config.load(args.config)
    except config.ConfigError as err:
        print(f"nvplug mps: {err}; nothing done (the daemon says so too)", file=sys.stderr)
        return None
    if not always and cfg.sharing.strategy != "mps" and not cfg.dra.enabled:
        return None  # nothing runs MPS: the device plugin's config has none, and no DRA claim can ask for it
    return RootLayout(Path(cfg.mps_root), Path(args.sysfs_root) / "fs/selinux/enforce")


def run_prepare(args: argparse.Namespace) -> int:
    layout = _layout(args)
    if layout is None:
        return 0
    try:
        notes = layout.prepare_root()
    except MpsDirError as err:
        print(f"nvplug mps prepare: {err}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"nvplug mps prepare: {note}", file=sys.stderr)
    print(f"nvplug mps prepare: {layout.root} ready, the clients' shm at {layout.shm}")
    return 0


def run_cleanup(args: argparse.Namespace) -> int:
    # Whatever the config says now: one changed since the prepare must not leave the tmpfs mounted.
    layout = _layout(args, always=True)
    if layout is None:
        return 0
    failed = layout.remove_root()
    if failed:
        print(f"nvplug mps cleanup: {failed}", file=sys.stderr)
        return 1
    return 0


def run_stop(args: argparse.Namespace) -> int:
    # What to stop is in the record, not the config: a config changed since must not hide a daemon.
    listen = status_client.listen_address(args.status_listen, args.config)
    try:
        status_client.fetch(listen, "/healthz", timeout=2.0)
    except OSError:
        pass  # nothing answers: nvplug is stopped
    else:
        print(
            f"nvplug mps stop: nvplug runs (its status endpoint at {listen} answers) and would start the daemons "
            "again: stop it first (systemctl stop nvplug)",
            file=sys.stderr,
        )
        return 1
    # What the record says of itself (unusable, of another boot), said as the rest of this command is.
    logging.basicConfig(level=logging.INFO, format="nvplug mps stop: %(message)s", stream=sys.stderr)
    directory = state_dir(args.state_dir, os.environ)
    # Any boot's record: each process is checked to be the recorded one (pid, start, binary), so one of an
    # earlier boot finds its daemons gone.
    records = DaemonRecords(directory, None)
    found = records.load()
    if not found:
        print(f"nvplug mps stop: no MPS control daemon recorded in {records.path}")
    daemons = [LeftoverDaemon(r, Path(r.pipe_dir).parent / LOG) for r in found.values()]
    settled = asyncio.run(_settle_all(daemons, args.force))
    kept = [d for d, gone in zip(daemons, settled, strict=True) if not gone]
    for daemon, gone in zip(daemons, settled, strict=True):
        if gone:
            records.drop(daemon.record.group)
            shutil.rmtree(daemon.record.pipe_dir, ignore_errors=True)
            how = "stopped" if daemon.found else "gone already"
            print(f"nvplug mps stop: MPS group {daemon.record.group}: control daemon pid {daemon.record.pid} {how}")
        else:
            clients = _clients_text(daemon.clients, Path(args.proc_root), Path(args.pod_logs))
            print(
                f"nvplug mps stop: MPS group {daemon.record.group}: control daemon pid {daemon.record.pid} has clients "
                f"({clients}): left running; --force cuts them off",
                file=sys.stderr,
            )
    held = {uuid for d in kept for uuid in d.record.exclusive}
    failed = _restore_modes(directory / FILE_NAME, held, Nvml(Path(args.sysfs_root), Path(args.proc_root)))
    return 1 if kept or failed else 0


def _clients_text(pids: tuple[int, ...], proc_root: Path, pod_logs: Path) -> str:
    """Each client's pid, and the pod it runs in (namespace/name where the kubelet's records tell)."""
    places = ProcessPlaces(proc_root, pod_logs.parent).place(pids)
    said = []
    for pid in pids:
        where = places.get(pid)
        if where is None or not where.pod_uid:
            said.append(f"pid {pid}")  # gone since, not ours to read, or in no pod
            continue
        pod = f"{where.namespace}/{where.pod}" if where.pod else f"UID {where.pod_uid}"
        # Its name where the kubelet's records have it, else the runtime's ID, as `crictl ps` shortens it.
        named = where.container or where.container_id[:13]
        container = f", container {named}" if named else ""
        said.append(f"pid {pid}: pod {pod}{container}")
    return "; ".join(said)


async def _settle_all(daemons: list[LeftoverDaemon], force: bool) -> list[bool]:
    return list(await asyncio.gather(*(d.settle(force) for d in daemons)))


def _restore_modes(path: Path, held: set[str], nvml: Nvml) -> bool:
    """The compute modes nvplug recorded (in any boot: the old mode is the one to go back to), back on the GPUs
    no daemon left running holds; the record of those done dropped. Whether one failed."""
    try:
        boot, saved = decode_all(path.read_bytes(), path)
    except FileNotFoundError:
        return False
    except (OSError, CheckpointError) as err:
        print(f"nvplug mps stop: no compute mode restored: {err}", file=sys.stderr)
        return True
    recorded = dict(saved.compute_modes)
    failed = False
    for uuid, mode in sorted(recorded.items()):
        if uuid in held:
            continue
        try:
            nvml.set_compute_mode(uuid, mode)
        except NvmlUnavailable as err:
            print(f"nvplug mps stop: {err}; the health state file keeps it for nvplug's next start", file=sys.stderr)
            failed = True
            continue
        del recorded[uuid]
        print(f"nvplug mps stop: {uuid}: compute mode back to {mode}")
    if recorded != saved.compute_modes:
        StateFile(path.parent, boot).save(replace(saved, compute_modes=recorded))
    return failed
