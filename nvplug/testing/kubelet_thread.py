"""A FakeKubelet on its own event loop in a daemon thread, for sync callers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.testing.fake_kubelet import FakeKubelet
from nvplug.testing.kubelet_plugin_client import DIAL_TIMEOUT_S, PRE_START_TIMEOUT_S, KubeletError
from nvplug.testing.kubelet_views import PluginView, RegistrationRecord
from nvplug.testing.podresources_standin import FakePodResources

_T = TypeVar("_T")


class KubeletThread:
    """Runs a FakeKubelet on a private event loop in a daemon thread, for sync code
    (pytest tests, the demo) that drives a plugin running in another process."""

    def __init__(
        self,
        plugin_dir: Path,
        *,
        dial_timeout: float = DIAL_TIMEOUT_S,
        clean_on_start: bool = True,
        on_event: Callable[[str], None] | None = None,
        pod_resources_socket: Path | None = None,
    ) -> None:
        self._kubelet = FakeKubelet(
            plugin_dir,
            dial_timeout=dial_timeout,
            clean_on_start=clean_on_start,
            on_event=on_event,
            pod_resources_socket=pod_resources_socket,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _submit(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise KubeletError(f"kubelet stand-in for {self._kubelet.plugin_dir} is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def start(self, timeout: float = 10.0, *, hang: bool = False) -> None:
        if self._thread is not None:
            raise KubeletError(f"kubelet stand-in for {self._kubelet.plugin_dir} already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=_run_loop, args=(loop,), name=f"fake-kubelet {self._kubelet.plugin_dir}", daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._submit(self._kubelet.start(hang=hang), timeout)
        except BaseException:
            self._halt_loop()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is None:
            return
        try:
            self._submit(self._kubelet.stop(), timeout)
        finally:
            self._halt_loop()

    def _halt_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10.0)

    def restart(self, timeout: float = 10.0, *, hang: bool = False) -> None:
        self._submit(self._kubelet.restart(hang=hang), timeout)

    def allocate(
        self, resource: str, device_ids: Sequence[str], *, timeout: float | None = None
    ) -> pb.AllocateResponse:
        return self._submit(self._kubelet.allocate(resource, device_ids, timeout=timeout))

    def admit(
        self, namespace: str, pod: str, container: str, resource: str, device_ids: Sequence[str]
    ) -> pb.AllocateResponse:
        return self._submit(self._kubelet.admit(namespace, pod, container, resource, device_ids))

    def delete_pod(self, namespace: str, pod: str) -> None:
        async def delete() -> None:
            self._kubelet.pod_resources.delete(namespace, pod)

        self._submit(delete())

    @property
    def pod_resources(self) -> FakePodResources:
        return self._kubelet.pod_resources

    def preferred_allocation(
        self,
        resource: str,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        *,
        check_options: bool = True,
        timeout: float | None = None,
    ) -> list[str]:
        return self._submit(
            self._kubelet.preferred_allocation(
                resource, available, must_include, size, check_options=check_options, timeout=timeout
            )
        )

    def pre_start(
        self,
        resource: str,
        device_ids: Sequence[str],
        *,
        check_options: bool = True,
        timeout: float = PRE_START_TIMEOUT_S,
    ) -> None:
        self._submit(self._kubelet.pre_start(resource, device_ids, check_options=check_options, timeout=timeout))

    def wait_for(self, predicate: Callable[[FakeKubelet], bool], timeout: float) -> None:
        """Block until predicate(kubelet) holds; it runs on the kubelet's loop."""
        self._submit(self._kubelet.wait_for(predicate, timeout), timeout + 5.0)

    # Reads return immutable snapshots, safe from this thread without hopping to the loop.
    @property
    def plugin_dir(self) -> Path:
        return self._kubelet.plugin_dir

    @property
    def socket_path(self) -> Path:
        return self._kubelet.socket_path

    @property
    def serving(self) -> bool:
        return self._kubelet.serving

    @property
    def hung(self) -> bool:
        return self._kubelet.hung

    @property
    def socket_created_at(self) -> float | None:
        return self._kubelet.socket_created_at

    @property
    def restarts(self) -> int:
        return self._kubelet.restarts

    @property
    def registrations(self) -> tuple[RegistrationRecord, ...]:
        return self._kubelet.registrations

    @property
    def plugins(self) -> Mapping[str, PluginView]:
        return self._kubelet.plugins

    @property
    def history(self) -> tuple[PluginView, ...]:
        return self._kubelet.history

    def plugin(self, resource: str) -> PluginView | None:
        return self._kubelet.plugin(resource)

    def views(self, resource: str) -> list[PluginView]:
        return self._kubelet.views(resource)

    def capacity(self, resource: str) -> int:
        return self._kubelet.capacity(resource)

    def allocatable(self, resource: str) -> int:
        return self._kubelet.allocatable(resource)

    def accepted_registrations(self, resource: str | None = None) -> int:
        return self._kubelet.accepted_registrations(resource)

    def describe(self) -> str:
        return self._kubelet.describe()

    def __enter__(self) -> KubeletThread:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # Let cancelled tasks (stream readers) finish before the loop goes away.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
