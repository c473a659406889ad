"""`pdcluster`'s command line: one module per subcommand, above the runtime (cluster)."""
