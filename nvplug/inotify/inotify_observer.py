"""watchdog's inotify observer, with a stop that cannot race its own thread: shared by every inotify watch."""

from __future__ import annotations

from watchdog.observers.api import BaseObserver
from watchdog.observers.inotify import InotifyEmitter
from watchdog.observers.inotify_c import InotifyFD


class Emitter(InotifyEmitter):
    """watchdog's emitter, stopped in an order that cannot race its own thread.

    InotifyEmitter.on_thread_stop() (watchdog 7.1, observers/inotify.py) first drops the watch group
    (`self._inotify = None`), then closes the group's queue. When the emitter thread is just then
    handling an event (one taken from the queue, or between loops), it finds the group gone and logs
    "InotifyEmitter.queue_events() called when the thread is inactive" at ERROR. Any event in the
    directory at that moment does it: our own sockets removed at shutdown, a restarting kubelet.

    Here the group is only closed. stop() has set the thread's stop flag already; closing the queue
    wakes a thread blocked in read_event() (it returns None), one that holds an event hands it on as
    usual, and either way the loop then sees the flag and ends. The group is never dropped under it.
    """

    def on_thread_stop(self) -> None:
        group = self._inotify
        # Also reached twice: from the thread itself when the directory is deleted, then from the observer.
        if group is not None and group.is_active:
            group.deactivate()


class InotifyObserver(BaseObserver):
    """InotifyObserver with Emitter: its own inotify fd and reader thread, ended after the emitters."""

    def __init__(self) -> None:
        self._inotify_fd = InotifyFD()
        self._inotify_fd.start()
        super().__init__(Emitter, inotify_fd=self._inotify_fd)

    def on_thread_stop(self) -> None:
        super().on_thread_stop()  # stops and joins the emitters first
        self._inotify_fd.stop()
        self._inotify_fd.join()
