"""CDI's spec and names, pure: shared by the spec's sink and every part that hands out CDI names."""
