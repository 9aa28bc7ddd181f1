"""Registration with the kubelet: once our server serves, again after every kubelet restart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import grpc

from nvplug.base.backoff import Backoff, sleep_unless
from nvplug.base.grpc_target import UNIX_SOCKET_OPTIONS, grpc_target
from nvplug.protos import API_VERSION, KUBELET_SOCKET
from nvplug.protos import deviceplugin_pb2 as pb
from nvplug.protos import deviceplugin_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The kubelet dials back inside Register with a 10 s timeout of its own.
REGISTER_TIMEOUT = 15.0


# Against a kubelet.sock that exists but does not answer yet: short, jittered, capped at 2 s.
REGISTER_BACKOFF = Backoff(first=0.05, maximum=2.0, jitter=True)

# How long a Register's own bookkeeping waits for the kubelet's first ListAndWatch, which it opens as
# it answers: a kubelet that lists later only delays the bookkeeping.
LIST_WAIT = 0.25


class RegistrationFailed(Exception):
    pass


class Listing(Protocol):
    """The server the kubelet lists from, which counts the ListAndWatch streams it has sent a first list on."""

    @property
    def streams_listed(self) -> int: ...

    async def listed_after(self, count: int) -> None: ...


class Registrar:
    """Keeps one resource registered.

    It never polls for kubelet.sock: `wake()` is called when the socket
    appears (or our own socket was re-created), and a backoff only paces
    retries against a socket that exists but does not answer yet. A wake
    also cancels a Register in flight: it went to a kubelet that is gone
    or hung, and would hold the node without capacity for REGISTER_TIMEOUT.
    """

    def __init__(
        self,
        plugin_dir: Path,
        resource_name: str,
        endpoint: str,
        options: pb.DevicePluginOptions,
        backoff: Backoff = REGISTER_BACKOFF,
        on_change: Callable[[], None] = lambda: None,
        listing: Listing | None = None,
    ) -> None:
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self.resource_name = resource_name
        self._endpoint = endpoint
        self._options = options
        self._backoff = backoff
        self._wanted = asyncio.Event()
        self._wanted.set()
        self.registered = asyncio.Event()
        self.registrations = 0
        self.failures = 0
        # Told whenever `registered` flips, for the status line.
        self._on_change = on_change
        self._listing = listing
        # The kubelet.sock the last Register went to (its device, inode and change time).
        self._with: tuple[int, int, int] | None = None
        # The Register in flight, which a wake cancels.
        self._call: asyncio.Task[None] | None = None

    def kubelet_came(self) -> None:
        """A kubelet.sock was created: register with it, unless the Register in flight (or done) is with
        that very socket. Its creation event can come after a rebind's Register reached it already,
        and cancelling that one would only register twice."""
        if self._with is not None and self._with == socket_identity(self.kubelet_socket):
            return
        self.wake()

    def wake(self) -> None:
        """Register (again) now: the kubelet restarted or our socket was rebound.
        A Register in flight or a backoff sleep is cut short, and a fresh attempt starts."""
        self.registered.clear()
        self._wanted.set()
        if self._call is not None:
            self._call.cancel()
        self._on_change()

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            if not self.kubelet_socket.exists():
                log.info("%s: waiting for %s", self.resource_name, self.kubelet_socket)
                continue
            await self._register_with_retry()

    async def _register_with_retry(self) -> None:
        # Paced by the policy as a schedule, not a retry loop's machinery: the first attempt is the one a
        # kubelet restart waits for, and it starts in the loop turn after the wake.
        retries = self._backoff.schedule()
        while True:
            if not self.kubelet_socket.exists():
                return  # the kubelet went away again; its next socket wakes us
            self._wanted.clear()
            try:
                if not await self._register_unless_woken():
                    return  # run() starts over at once, against the new kubelet.sock
            except RegistrationFailed as err:
                delay = retries.next()
                log.warning("%s; retry %d in %.2fs", err, retries.failures, delay)
                # A new kubelet socket cuts the backoff short.
                await sleep_unless(self._wanted, delay)
                continue
            break
        self.registered.set()
        self._on_change()

    async def _register_unless_woken(self) -> bool:
        """One Register, which wake() cancels. False when a wake came first: `registered` stays clear,
        since the call was not this kubelet's."""
        # Counted as the kubelet answers: a wake after that cancels no Register, only the wait for the list.
        registrations = self.registrations
        call = self._call = asyncio.create_task(self._register_once(), name=f"Register {self.resource_name}")
        try:
            # Waited on, not awaited: the wake's cancel of the call is no cancel of this task.
            await asyncio.wait((call,))
        finally:
            self._call = None
            call.cancel()
            # Let the cancelled call close its channel before anything else runs.
            await asyncio.wait((call,))
        if call.cancelled():
            if self.registrations > registrations:
                self._log_registered()  # by the kubelet that a new kubelet.sock has just replaced
                return False
            log.info(
                "%s: Register to the old kubelet cancelled: a new kubelet.sock appeared (%s)",
                self.resource_name,
                self.kubelet_socket,
            )
            return False
        call.result()  # RegistrationFailed goes to the retry loop
        # Accepted just as a wake came: maybe by the old kubelet, so register again.
        return not self._wanted.is_set()

    async def _register_once(self) -> None:
        self._with = socket_identity(self.kubelet_socket)
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self._endpoint,
            resource_name=self.resource_name,
            options=self._options,
        )
        try:
            # A connection of our own each time: one from gRPC's shared pool may still
            # lead to the old kubelet, which holds on to it while its socket file is gone.
            async with grpc.aio.insecure_channel(
                grpc_target(self.kubelet_socket), options=[*UNIX_SOCKET_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                listed = self._listing.streams_listed if self._listing is not None else 0
                await pb_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT)
                self.registrations += 1
                await self._listed_after(listed)
        except grpc.aio.AioRpcError as err:
            self.failures += 1
            raise RegistrationFailed(
                f"{self.resource_name}: Register on {self.kubelet_socket} failed: {err.code().name}: {err.details()}"
            ) from err
        self._log_registered()

    def _log_registered(self) -> None:
        log.info(
            "%s: registered with the kubelet on %s (endpoint %s)",
            self.resource_name,
            self.kubelet_socket,
            self._endpoint,
        )

    async def _listed_after(self, count: int) -> None:
        """The kubelet opens ListAndWatch as it answers Register: its first list goes out before this
        Register's own bookkeeping (the channel's close, the log, the status line), which would otherwise
        hold the loop while that stream's request waits."""
        if self._listing is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._listing.listed_after(count), LIST_WAIT)


def socket_identity(path: Path) -> tuple[int, int, int] | None:
    """Which file is at `path`: a new kubelet's socket differs in its change time even where its inode
    number is the old one's again."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns
