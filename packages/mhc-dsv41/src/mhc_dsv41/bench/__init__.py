"""DSV4.1's benchmarks, declared in its registry entry (``mhc_dsv41.model``): its own suites
(``suites``: ``--suite dsv41 dsv41-geometry``), its unfused torch boundary (``baseline``), and what the
generic suites need of it (``case``, ``host``). Run by the repository's ``python3 -m benchmarks.run``."""
