"""The DRA kubelet plugin's sockets: registration in plugins_registry, and the DRA service.

The kubelet finds `<driver>-reg.sock` in its plugins_registry directory, asks GetInfo,
dials the endpoint it names (`plugins/<driver>/dra.sock`) and says through
NotifyRegistrationStatus whether that worked. The DRA service answers as v1 (kubelets
1.34 and later) and as v1beta1 (1.32, 1.33) on the same socket: the messages are the same,
only the package differs, and each kubelet picks the first of our services it knows.

Each socket name is a hard link to its server's listener under `.nvplug/` beside it, as the
device plugin's are: a socket removed is served again by linking its name again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

from nvplug.base.linked_socket_server import LinkedSocketServer, remove_leftover_listeners
from nvplug.dra.claims import ClaimError, ClaimRef, PreparedClaim
from nvplug.protos import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

log = logging.getLogger("nvplug.dra")

PLUGIN_TYPE = "DRAPlugin"
# Ours first: a kubelet takes the first it supports (1.34+), or looks for v1beta1 (1.32, 1.33).
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
_VERSIONS: tuple[ModuleType, ...] = (dra_v1_pb2, dra_v1beta1_pb2)

Prepare = Callable[[ClaimRef], Awaitable[PreparedClaim]]
Unprepare = Callable[[ClaimRef], Awaitable[None]]
Registered = Callable[[bool, str], None]


class DraSockets:
    """Both servers; the DRA service is up before registration, since the kubelet dials it inside it."""

    def __init__(
        self,
        driver: str,
        registry_dir: Path,
        plugins_dir: Path,
        prepare: Prepare,
        unprepare: Unprepare,
        on_registration: Registered,
        extra: Sequence[grpc.GenericRpcHandler] = (),
        extra_services: Sequence[str] = (),
    ) -> None:
        """`extra`: more services on the plugin's socket (the resource-health stream), whose names
        `extra_services` lists in GetInfo (a kubelet from 1.37 on picks its health service there)."""
        self.driver = driver
        self.registration_socket = registry_dir / f"{driver}-reg.sock"
        self.plugin_socket = plugins_dir / driver / "dra.sock"
        self._prepare = prepare
        self._unprepare = unprepare
        self._on_registration = on_registration
        self._services = (*SERVICES, *extra_services)
        dra = [_dra_handler(pb, self._node_prepare, self._node_unprepare) for pb in _VERSIONS]
        # The plugin's first: the kubelet dials it inside registration.
        self._servers = {
            self.plugin_socket: LinkedSocketServer(self.plugin_socket, [*dra, *extra], driver, log),
            self.registration_socket: LinkedSocketServer(
                self.registration_socket, [self._registration_handler()], driver, log
            ),
        }

    @property
    def sockets(self) -> tuple[Path, Path]:
        return self.plugin_socket, self.registration_socket

    async def start(self) -> None:
        for path, server in self._servers.items():
            # At start the directories are made, as the unit's first run on a node may need.
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_leftover_listeners(path.parent)
            await server.start()

    def serving(self, path: Path) -> bool:
        return self._servers[path].serving

    async def stop(self) -> None:
        # Registration first: once its socket is gone the kubelet deregisters us.
        for path in (self.registration_socket, self.plugin_socket):
            await self._servers[path].stop(0.5)

    async def rebind(self, path: Path) -> None:
        """One of our sockets was removed: serve it again, by a link to its listener (the registration
        one re-registers us); by a new server only if the listener went too (its directory did).

        Its directory is not made here: one that went with the kubelet's is made again by the kubelet
        (or, ours, by the directory watch once its parent is back), never in the middle of a wipe."""
        await self._servers[path].rebind()

    def _registration_handler(self) -> grpc.GenericRpcHandler:
        pb = pluginregistration_pb2

        async def get_info(request: Any, context: Any) -> Any:
            return pb.PluginInfo(
                type=PLUGIN_TYPE, name=self.driver, endpoint=str(self.plugin_socket), supported_versions=self._services
            )

        async def notify(request: Any, context: Any) -> Any:
            self._on_registration(bool(request.plugin_registered), str(request.error))
            return pb.RegistrationStatusResponse()

        return grpc.method_handlers_generic_handler(
            "pluginregistration.Registration",
            {
                "GetInfo": grpc.unary_unary_rpc_method_handler(
                    get_info, pb.InfoRequest.FromString, pb.PluginInfo.SerializeToString
                ),
                "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                    notify, pb.RegistrationStatus.FromString, pb.RegistrationStatusResponse.SerializeToString
                ),
            },
        )

    async def _node_prepare(self, claims: list[ClaimRef]) -> dict[str, PreparedClaim | str]:
        out: dict[str, PreparedClaim | str] = {}
        for ref in claims:
            try:
                out[ref.uid] = await self._prepare(ref)
            except ClaimError as err:
                log.warning("NodePrepareResources refused: %s", err)
                out[ref.uid] = str(err)
        return out

    async def _node_unprepare(self, claims: list[ClaimRef]) -> dict[str, str]:
        out: dict[str, str] = {}
        for ref in claims:
            try:
                await self._unprepare(ref)
                out[ref.uid] = ""
            except ClaimError as err:
                out[ref.uid] = str(err)
        return out


def _dra_handler(
    pb: ModuleType,
    prepare: Callable[[list[ClaimRef]], Awaitable[dict[str, PreparedClaim | str]]],
    unprepare: Callable[[list[ClaimRef]], Awaitable[dict[str, str]]],
) -> grpc.GenericRpcHandler:
    """DRAPlugin in one version's package; every claim asked about gets an entry, an error or its devices."""

    async def node_prepare(request: Any, context: Any) -> Any:
        results = await prepare([ClaimRef(c.namespace, c.name, c.uid) for c in request.claims])
        response = pb.NodePrepareResourcesResponse()
        for uid, result in results.items():
            entry = response.claims[uid]
            if isinstance(result, str):
                entry.error = result
                continue
            for d in result.devices:
                entry.devices.add(
                    request_names=d.requests, pool_name=d.pool, device_name=d.device, cdi_device_ids=d.cdi_ids
                )
        return response

    async def node_unprepare(request: Any, context: Any) -> Any:
        results = await unprepare([ClaimRef(c.namespace, c.name, c.uid) for c in request.claims])
        response = pb.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            response.claims[uid].error = error
        return response

    return grpc.method_handlers_generic_handler(
        f"{pb.DESCRIPTOR.package}.DRAPlugin",
        {
            "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                node_prepare,
                pb.NodePrepareResourcesRequest.FromString,
                pb.NodePrepareResourcesResponse.SerializeToString,
            ),
            "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                node_unprepare,
                pb.NodeUnprepareResourcesRequest.FromString,
                pb.NodeUnprepareResourcesResponse.SerializeToString,
            ),
        },
    )
