"""Command-line interface: one module per subcommand, registered in ingero.cli.main."""
