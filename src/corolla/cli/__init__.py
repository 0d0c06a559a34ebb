"""The `corolla` command: one entry point, a small module per subcommand."""
