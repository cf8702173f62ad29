"""The call path: one call of an op, declared, checked, bound and run, above ``binaries``.

``rules`` (each call's parameters, declared once) and ``validation``, ``moe`` and ``layer_input``
(the inputs' forms), ``programs`` (call forms bound into the native executor), ``call_forms``,
``eager`` and ``two_phase`` (the op's ways of calling), ``warmup``, ``streams`` (ordering across
streams and captures), ``spin`` (the bound on every poll, the error report, the exceptions) and
``contract`` (what a model's op declares). Imports ``binaries``, never ``ranks`` or the ops.
"""
