"""The daemon: sources, core and sinks wired around one asyncio loop."""
