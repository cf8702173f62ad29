"""mhc-core's version: the one source (``pyproject.toml``'s ``[tool.hatch.version]`` reads it), kept apart
so that the modules that report it need not import the package above them."""

__version__ = "0.6.0"
