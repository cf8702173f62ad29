"""GLM-5.3's benchmarks, declared in its registry entry (``mhc_glm5.model``): its own suites
(``suites``: ``--suite glm5 glm5-thresholds glm5-persistent glm5-breakdown``; ``overlap``:
``--suite glm5-overlap``), its unfused torch boundary (``baseline``), and what the generic suites need
of it (``case``, ``host``). Run by the repository's ``python3 -m benchmarks.run``."""
