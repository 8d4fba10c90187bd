"""The settings: every key and flag (keys.py), the rules between them (config.py), and the
command line and YAML files read through them (cli.py). Skip on a first reading."""
