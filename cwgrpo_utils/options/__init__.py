"""The command lines, read before torch is imported: the algorithm's options (config.py: Config,
METHODS, parse_config), the run's (run_config.py: RunConfig), the presets whose values are
their defaults (presets.py), and how a dataclass becomes a command line (cli.py)."""
