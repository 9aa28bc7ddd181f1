"""The kubelet device-plugin side: one endpoint per resource, its gRPC service, registration, Allocate, PodResources."""
