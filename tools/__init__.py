"""The project's command line: `python -m tools --help`."""
