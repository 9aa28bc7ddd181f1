"""Which pod holds which device, pure: shared by the PodResources reader, the DRA driver and the status routes."""
