"""Sources: NVML, udev, inotify and the re-prober, each feeding typed events to the bus."""
