"""The simulated node that `nvplug demo` and the tests run: fake NVML (C), kubelet stand-in, udev sender."""
