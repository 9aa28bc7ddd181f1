"""The kubelet's device-plugin API v1beta1: generated messages and the contract's constants."""

API_VERSION = "v1beta1"
# The kubelet's own socket in the device-plugin directory.
KUBELET_SOCKET = "kubelet.sock"
