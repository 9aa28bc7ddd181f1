"""The `nvplug` command line: one module per subcommand."""
