"""CDI: the Container Device Interface spec nvplug writes for the device names it hands out."""
