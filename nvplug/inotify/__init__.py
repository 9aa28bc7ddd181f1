"""inotify, read on watchdog's observer thread or on the loop: shared by the sources' watches and by
MPS's control.log watch."""
