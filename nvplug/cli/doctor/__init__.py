"""`nvplug doctor`: the failure chain from the kernel driver to the kubelet, step by step."""
