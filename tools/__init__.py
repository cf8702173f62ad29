"""Developer tools run as ``python3 -m tools.<name>`` from the repository root."""
