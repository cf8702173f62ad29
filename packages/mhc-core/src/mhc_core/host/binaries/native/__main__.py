"""``python3 -m mhc_core.host.binaries.native [TARGET]``: build the host library (see the package docstring)."""

from . import main

raise SystemExit(main())
