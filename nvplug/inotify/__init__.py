"""inotify read on the loop, through our own libc binding: shared by the sources' watches and by MPS's
control.log watch."""
