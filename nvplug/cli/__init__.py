"""The `nvplug` command line: the registry of subcommands (command_registry), a module for each one's run."""
