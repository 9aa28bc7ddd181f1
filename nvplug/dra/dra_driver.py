"""The DRA driver: one more sink of the node's state, beside the device plugin.

It owns the GPUs nvplug.dra gives it (the device plugin does not offer them), keeps
the node's ResourceSlices equal to its pool, and prepares claims from the CDI names
of the node's spec. Nothing here can stop the device plugin: API errors back off, and
a claim that cannot be prepared fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from nvplug.base.backoff import Backoff, keep_trying
from nvplug.cdi.cdi_spec import GPU_KIND, device_name, qualified
from nvplug.config import Config
from nvplug.core.events import Event, NotesChanged, PluginSocketRemoved, WatchedDirChanged
from nvplug.core.snapshot import REVISED, Snapshot
from nvplug.dra import claims, resource_health
from nvplug.dra.api_client import ApiClient, ApiError, KubeConfigError
from nvplug.dra.claim_setup import ClaimDaemons, ClaimSetup
from nvplug.dra.claim_specs import ClaimSpecs
from nvplug.dra.claims import ClaimError, ClaimRef, ClaimStore, PreparedClaim, PreparedDevice
from nvplug.dra.device_taints import unmonitored
from nvplug.dra.dra_credentials import load_kubeconfig
from nvplug.dra.dra_devices import DraDevice, offered
from nvplug.dra.dra_sockets import DraSockets
from nvplug.dra.resource_health import DeviceReport, HealthStream
from nvplug.dra.resource_slices import GROUP
from nvplug.dra.slice_publisher import DEFAULT_BUDGET, FAILURES, SlicePublisher
from nvplug.dra.time_slices import TimeSlicer
from nvplug.edges.edge_protocols import Commit, Emit, HealthVerdict, Sink, StateUpdate
from nvplug.pods.pod_holders import ContainerDevices, Holder
from nvplug.shaping.resource_plan import Naming

log = logging.getLogger("nvplug.dra")

# A DRA socket that cannot be served again (its directory gone with the kubelet's): retried, never left
# undone. The directory made again cuts the wait short, so the cap can be long.
DRA_REBIND_BACKOFF = Backoff(first=0.1, maximum=10.0, jitter=True)
# How long a reload waits for the API server to hold a pool that gave GPUs up, before the device plugin
# offers them: beyond it they are offered anyway (prepare refuses a device no longer in the pool).
RELEASE_SECONDS = 10.0


def health_reports(devices: Sequence[DraDevice]) -> list[DeviceReport]:
    """Each device's health for the kubelet, as its taints say it: Unknown while nvplug cannot check it
    and knows no fault of it (a known fault stays Unhealthy through a hang)."""
    out = []
    for d in devices:
        if unmonitored(d.taints):
            why = d.reason if not d.healthy else "an NVML call on its GPU does not return"
            out.append(DeviceReport(d.name, "Unknown", f"nvplug cannot check it: {why}"))
        elif d.healthy:
            out.append(DeviceReport(d.name, "Healthy"))
        else:
            out.append(DeviceReport(d.name, "Unhealthy", d.reason))
    return out


def _described(device: PreparedDevice) -> str:
    sharing = device.sharing
    how = "" if sharing is None else f", {sharing.strategy}" + (f" {sharing.interval}" if sharing.mps is None else "")
    return f"{device.device} ({device.uuid}{how})"


def node_name(cfg: Config) -> str:
    """nvplug.dra.nodeName, else this host's name as the kubelet takes it (lower case)."""
    return cfg.dra.node_name or socket.gethostname().lower()


class DraDriver(Sink):
    """A sink of the node's state beside the device plugin: the pool, its slices, and the claims."""

    name = "dra"
    reads = REVISED
    # Before the fleet's (the wiring's order): its sockets lie beside the device plugins'.
    works = frozenset({PluginSocketRemoved, WatchedDirChanged})

    def __init__(
        self,
        cfg: Config,
        state_dir: Path | None,
        emit: Emit | None = None,
        boot_id: str | None = None,
        mps: ClaimDaemons | None = None,
        spec_dir: Path | None = None,
    ) -> None:
        dra = cfg.dra
        self.driver = dra.driver_name
        self.node = node_name(cfg)
        self.naming = Naming.from_config(cfg)
        self.effects = dra.taint_effect
        self.id_strategy = cfg.flags.plugin.device_id_strategy
        client: ApiClient | None = None
        error = None
        try:
            kubeconfig = load_kubeconfig(dra)
            client = ApiClient(kubeconfig)
            log.info("DRA: the API server at %s, with the credentials of %s", kubeconfig.server, kubeconfig.source)
        except KubeConfigError as err:
            error = str(err)
            log.error("DRA: %s; no ResourceSlices are published and no claim can be prepared", err)
        self.client = client
        self._emit = emit
        budget = replace(DEFAULT_BUDGET, per_second=dra.max_writes_per_second)
        self.publisher = SlicePublisher(client, self.driver, self.node, error, self._on_change, budget)
        self.claims = ClaimStore(state_dir / claims.CHECKPOINT if state_dir is not None else None, boot_id)
        # Sharing and the claims' own specs; one claim at a time, since claims may share a device.
        self.setup = ClaimSetup(self.claims, ClaimSpecs(spec_dir), TimeSlicer(), mps)
        self._claim_lock = asyncio.Lock()
        # Whether the checkpoint is read: the claims' restore needs it.
        self._started = False
        self.health = HealthStream(self.node)
        self.sockets = DraSockets(
            self.driver,
            Path(dra.registry_dir),
            Path(dra.plugins_dir),
            self.prepare_claim,
            self.unprepare_claim,
            self._registered,
            self.health.handlers(),
            resource_health.SERVICES,
        )
        self.registered = False
        self.registration_error: str | None = None
        self.devices: list[DraDevice] = []
        self._task: asyncio.Task[None] | None = None
        # Our sockets to serve again, why they cannot be now (naming the directory or the socket),
        # and the one task that serves them, backing off while it cannot.
        self._lost: set[Path] = set()
        self.not_served: str | None = None
        self._restoring: asyncio.Task[None] | None = None
        self._retry_now = asyncio.Event()
        self._closing = False

    async def open(self, snapshot: Snapshot) -> None:
        """Serve the DRA sockets, with the claims checkpointed before."""
        self.claims.load()
        self._started = True
        self.setup.restore(snapshot)
        try:
            await self.sockets.start()
        except (OSError, RuntimeError) as err:
            # The device plugin goes on; the status line and doctor say why DRA does not, and it is retried.
            self.not_served = f"cannot serve the DRA sockets: {err}"
            log.error("%s: %s (is the directory writable? see the unit's DRA drop-in)", self.driver, err)
            for path in self.sockets.sockets:
                if not self.sockets.serving(path):
                    self._lose(path)
        self._task = asyncio.create_task(self.publisher.run(), name="dra slices")

    def _on_change(self) -> None:
        """A write or an error of DRA's changed its notes: the status report refreshes its line."""
        if self._emit is not None:
            self._emit(NotesChanged())

    async def work(self, event: Event) -> None:
        match event:
            case PluginSocketRemoved(path=path):
                self.socket_removed(Path(path))
            case WatchedDirChanged(path=path, exists=exists):
                self.dir_changed(Path(path), exists)
            case _:
                pass

    def socket_removed(self, path: Path) -> None:
        """One of the sockets in the watched directories vanished: serve it again if it is ours."""
        # Only if it is still gone: a rebind whose listener went too stops the old server, which removes the name.
        if path in self.sockets.sockets and not path.exists() and path not in self._lost:
            log.warning("%s was removed: serving it again", path)
            if path == self.sockets.registration_socket:
                # The kubelet deregisters a plugin whose registration socket is gone, until it finds a new one.
                self.registered = False
                self._on_change()
            self._lose(path)

    def dir_changed(self, path: Path, exists: bool) -> None:
        """A watched directory went (with the kubelet's) or came back: serve our sockets in it again."""
        ours = [s for s in self.sockets.sockets if s.parent == path]
        if not ours:
            return
        if exists:
            self._retry_now.set()  # a bind backing off tries again now
        else:
            self.not_served = f"{path} is missing (served again once it is made again)"
            if self.sockets.registration_socket in ours:
                self.registered = False  # its socket went with it
            self._on_change()
        for socket_path in ours:
            if not socket_path.exists():
                self._lose(socket_path)

    def _lose(self, path: Path) -> None:
        self._lost.add(path)
        self._retry_now.set()
        if not self._closing and (self._restoring is None or self._restoring.done()):
            self._restoring = asyncio.create_task(self._restore(), name="dra sockets")

    async def _restore(self) -> None:
        """Serve every lost socket again, the plugin's first (the kubelet dials it inside registration);
        a bind that fails is retried with backoff, never left undone."""
        while self._lost:  # one lost again while the others were bound
            bound = await keep_trying(
                self._rebind_lost,
                DRA_REBIND_BACKOFF,
                self._bind_failed,
                (OSError, RuntimeError),
                self._retry_now,
                lambda: self._closing,
            )
            if bound is None:
                return
        if self.not_served is not None:
            log.info("%s: serving the DRA sockets again", self.driver)
            self.not_served = None
            self._on_change()

    async def _rebind_lost(self) -> None:
        for path in self.sockets.sockets:
            if path in self._lost:
                await self.sockets.rebind(path)
                self._lost.discard(path)

    def _bind_failed(self, err: Exception, delay: float) -> None:
        if str(err) != self.not_served:
            log.warning("%s: %s; retrying (next in %.2fs)", self.driver, err, delay)
        self.not_served = str(err)
        self._on_change()

    async def close(self) -> None:
        self._closing = True
        self._retry_now.set()
        if self._restoring is not None:
            await asyncio.gather(self._restoring, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.sockets.stop()
        await self.setup.close()
        if self.client is not None:
            await self.client.close()

    def prepare(self, cfg: Config) -> Commit:
        """A reloaded config: nvplug.dra's devices, extendedResources and taintEffect (the rest of it takes a
        restart), nvplug.devices, the MIG strategy and the ID strategy shape the pool. A pool that gives GPUs
        up is held by the API server before the commit ends: the device plugin may offer them next."""
        naming = Naming.from_config(cfg)

        async def commit(snapshot: Snapshot) -> None:
            self.naming = naming
            self.effects = cfg.dra.taint_effect
            self.id_strategy = cfg.flags.plugin.device_id_strategy
            before = {d.uuid for d in self.devices}
            self.offer(snapshot)
            gone = before - {d.uuid for d in self.devices}
            if gone and not await self.publisher.held(RELEASE_SECONDS):
                log.warning(
                    "%s: the API server does not hold the pool without %s yet (%s); the device plugin "
                    "may offer them meanwhile, and prepare refuses them",
                    self.driver,
                    ", ".join(sorted(gone)),
                    self.publisher.error or "no answer",
                )

        return commit

    def update(self, update: StateUpdate) -> Sequence[Event]:
        if update.revised:
            if self._started:
                self.setup.restore(update.snapshot)
            self.offer(update.snapshot)
        return ()

    def notes(self) -> list[str]:
        if self.not_served:
            return [f"DRA {self.driver} not served: {self.not_served}"]
        if self.publisher.error:
            return [f"DRA {self.driver}: {self.publisher.error}"]
        how = (
            "registered"
            if self.registered
            else f"not registered ({self.registration_error or 'waiting for the kubelet'})"
        )
        healthy = sum(1 for d in self.devices if d.healthy)
        if self.registered and not self.publisher.published:
            change = self.publisher.foreign_change
            why = f" ({change['what']} by someone else)" if change else ""
            return [f"DRA {self.driver} {how}: the API server does not hold its ResourceSlices yet{why}; writing them"]
        return [f"DRA {self.driver} {how}: {healthy} devices in {len(self.publisher.slice_names)} ResourceSlices"]

    def verdict(self) -> HealthVerdict:
        """Unhealthy while its sockets cannot be served; while the API server does not hold its slices yet,
        /healthz says what it does hold (not what nvplug last wrote)."""
        waiting = self.registered and not self.publisher.published
        return HealthVerdict(not self.not_served, tuple(self.notes()) if waiting else ())

    def offer(self, snapshot: Snapshot) -> None:
        """A new state: the pool as it is now, published if it changed, its health streamed."""
        devices = offered(snapshot, self.naming, self.effects)
        if devices != self.devices:
            self.devices = devices
            self.publisher.want(devices)
        self.health.update(health_reports(devices))

    def owned(self, snapshot: Snapshot) -> set[str]:
        """The UUIDs of the GPUs offered through DRA."""
        return {g.uuid for g in snapshot.gpus if self.naming.dra_owns(g)}

    async def prepare_claim(self, ref: ClaimRef) -> PreparedClaim:
        async with self._claim_lock:
            return await self._prepare_claim(ref)

    async def _prepare_claim(self, ref: ClaimRef) -> PreparedClaim:
        done = self.claims.get(ref.uid)
        if done is not None:
            return done  # asked again (a kubelet restart): the same answer
        if self.client is None:
            raise ClaimError(f"{ref}: cannot read the claim: {self.publisher.error}")
        try:
            version = self.publisher.version or await self.publisher.discover(self.client)
            path = f"/apis/{GROUP}/{version}/namespaces/{ref.namespace}/resourceclaims/{ref.name}"
            claim = await self.client.request("GET", path)
        except FAILURES as err:
            why = "not found" if isinstance(err, ApiError) and err.status == 404 else str(err)
            raise ClaimError(f"{ref}: cannot read the claim from the API server: {why}") from err
        # Taints the API server does not keep let nothing through: the device left the pool instead.
        pool = {d.name: d if self.publisher.taints else replace(d, taints=()) for d in self.devices}
        prepared = await self.setup.apply(claims.prepare(ref, claim, self.driver, self.node, pool, self._cdi_ids), pool)
        # Saved before the answer: a restart right after still knows what was handed out.
        self.claims.put(prepared)
        log.info("prepared %s: %s", ref, ", ".join(map(_described, prepared.devices)) or "no devices")
        return prepared

    async def unprepare_claim(self, ref: ClaimRef) -> None:
        async with self._claim_lock:
            prepared = self.claims.get(ref.uid)
            if prepared is not None and self.claims.remove(ref.uid):
                await self.setup.undo(prepared)
                log.info("unprepared %s", ref)

    def _cdi_ids(self, device: DraDevice) -> tuple[str, ...]:
        """The node spec's name of the device: the spec the device plugin's names point to."""
        return (qualified(GPU_KIND, device_name(device.gpu, device.mig, self.id_strategy)),)

    def _registered(self, ok: bool, error: str) -> None:
        self.registered = ok
        self.registration_error = None if ok else error or "refused"
        self._on_change()
        if ok:
            log.info("%s: registered with the kubelet as a DRA plugin; publishing ResourceSlices", self.driver)
            # The kubelet deletes its node's slices when it starts.
            self.publisher.republish()
        else:
            log.error("%s: the kubelet refused the DRA plugin: %s", self.driver, self.registration_error)

    def by_gpu(self) -> dict[str, list[dict[str, object]]]:
        """Each GPU's devices in the pool (itself, or its MIG devices) and the claims prepared with them."""
        out: dict[str, list[dict[str, object]]] = {}
        for d in self.devices:
            entry = {
                "driver": self.driver,
                "device": d.name,
                "uuid": d.uuid,
                "healthy": d.healthy,
                "claims": self._held(d),
                "taints": self.publisher.shown_taints(d),
            }
            out.setdefault(d.gpu.uuid, []).append(entry)
        return out

    def holders(self, entries: Iterable[ContainerDevices] = ()) -> dict[str, list[Holder]]:
        """The pods that hold each DRA device (by GPU or MIG UUID): from the kubelet's PodResources where it
        lists dynamic resources (1.36: with the container), else from the prepared claims' pods."""
        by_name = {d.name: d.uuid for d in self.devices}
        out: dict[str, list[Holder]] = {}
        listed: set[tuple[str, str]] = set()
        for entry in entries:
            if entry.pool != self.node or entry.resource != self.driver:
                continue
            for name in entry.device_ids:
                uuid = by_name.get(name)
                if uuid is not None:
                    listed.add((entry.namespace, entry.claim or ""))
                    holder = Holder(
                        entry.namespace,
                        entry.pod,
                        entry.container,
                        self.driver,
                        name,
                        claim=entry.claim,
                        pool=self.node,
                    )
                    out.setdefault(uuid, []).append(holder)
        for prepared in self.claims:
            ref = prepared.claim
            if (ref.namespace, ref.name) in listed:
                continue
            for device in prepared.devices:
                for pod in prepared.pods:
                    holder = Holder(ref.namespace, pod, "", self.driver, device.device, claim=ref.name, pool=self.node)
                    out.setdefault(device.uuid, []).append(holder)
        return out

    def _held(self, device: DraDevice) -> list[str]:
        """The claims prepared with the device, as namespace/name."""
        return [f"{c.claim.namespace}/{c.claim.name}" for c in self.claims.holding(device.uuid)]

    def status(self) -> dict[str, object]:
        return {
            **self.publisher.status(),
            "registered": self.registered,
            "registration_error": self.registration_error,
            "not_served": self.not_served,
            "registry_socket": str(self.sockets.registration_socket),
            "health_streams": self.health.streams,
            "plugin_socket": str(self.sockets.plugin_socket),
            "devices": [
                {
                    "name": d.name,
                    "uuid": d.uuid,
                    "healthy": d.healthy,
                    "claims": self._held(d),
                    "taints": self.publisher.shown_taints(d),
                }
                for d in self.devices
            ],
            "claims": [
                {
                    "namespace": c.claim.namespace,
                    "name": c.claim.name,
                    "uid": c.claim.uid,
                    "devices": [d.device for d in c.devices],
                    "cdi": [n for d in c.devices for n in d.cdi_ids],
                    "mps_group": c.mps_group,
                }
                for c in self.claims
            ],
        }
