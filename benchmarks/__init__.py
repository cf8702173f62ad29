"""Benchmarks of the fused ops against the unfused baselines an engine runs today (``nox -s bench``)."""
