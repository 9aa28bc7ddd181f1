"""The kubelet stand-in's side of container admission: its calls into a registered plugin.

Allocate, GetPreferredAllocation and PreStartContainer as the kubelet makes them,
refused where the kubelet would not make them, and the admitted pods and
allocatable devices that the stand-in's PodResources serves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.kubelet_plugin_client import PRE_START_TIMEOUT_S, KubeletError, PluginConnection
from nvplug.testing.kubelet_views import PluginView
from nvplug.testing.podresources_standin import Container, FakePodResources, Pod


class KubeletAdmission:
    """FakeKubelet's calls into its plugins, on its event loop only.

    A base class of FakeKubelet, apart so that registration and admission read
    apart: FakeKubelet sets the attributes below and keeps them current.
    """

    pod_resources: FakePodResources
    # The live connection and the published view per resource, as FakeKubelet's registrations left them.
    _conns: dict[str, PluginConnection]
    _plugins: Mapping[str, PluginView]

    def _connected(self, resource: str, rpc: str) -> tuple[PluginConnection, PluginView]:
        conn = self._conns.get(resource)
        view = self._plugins.get(resource)
        if conn is None or view is None or view.serial != conn.serial:
            why = "no plugin registered" if view is None else f"stream ended ({view.stream_end})"
            raise KubeletError(f"cannot call {rpc} for {resource!r}: {why} (endpoint stopped)")
        return conn, view

    async def allocate(
        self, resource: str, device_ids: Sequence[str], *, timeout: float | None = None
    ) -> pb.AllocateResponse:
        """One Allocate with one ContainerAllocateRequest, as at container admission.
        The kubelet sets no deadline; `timeout` exists only to keep tests bounded."""
        conn, _ = self._connected(resource, "Allocate")
        return await conn.allocate(device_ids, timeout)

    async def admit(
        self, namespace: str, pod: str, container: str, resource: str, device_ids: Sequence[str]
    ) -> pb.AllocateResponse:
        """A container admitted as the kubelet does it: Allocate, then the pod is on record for PodResources."""
        response = await self.allocate(resource, device_ids)
        known = self.pod_resources.pods.get((namespace, pod))
        containers = {c.name: c for c in (known.containers if known else ())}
        held = dict(containers[container].devices) if container in containers else {}
        held[resource] = (*held.get(resource, ()), *device_ids)
        containers[container] = Container(container, held)
        self.pod_resources.admit(Pod(namespace, pod, tuple(containers.values())))
        return response

    def _allocatable(self) -> Mapping[str, tuple[str, ...]]:
        """The healthy devices of every resource the kubelet knows, a stopped endpoint's included."""
        return {name: tuple(d.id for d in v.devices.values() if d.healthy) for name, v in self._plugins.items()}

    async def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        *,
        check_options: bool = True,
        timeout: float | None = None,
    ) -> list[str]:
        """The plugin's answer (container_responses[0].deviceIDs), unfiltered. The kubelet
        only calls this when the plugin advertised it; `check_options=False` skips that."""
        conn, view = self._connected(resource, "GetPreferredAllocation")
        if check_options and not view.options.get_preferred_allocation_available:
            raise KubeletError(
                f"plugin for {resource!r} did not advertise get_preferred_allocation_available; "
                "the kubelet would not call GetPreferredAllocation"
            )
        return await conn.preferred_allocation(available, must_include, size, timeout)

    async def pre_start(
        self,
        resource: str,
        device_ids: Sequence[str],
        *,
        check_options: bool = True,
        timeout: float = PRE_START_TIMEOUT_S,
    ) -> None:
        conn, view = self._connected(resource, "PreStartContainer")
        if check_options and not view.options.pre_start_required:
            raise KubeletError(
                f"plugin for {resource!r} did not set pre_start_required; the kubelet would not call PreStartContainer"
            )
        await conn.pre_start(device_ids, timeout)
