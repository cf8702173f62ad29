"""``python3 -m demo``: see ``demo.run``."""

import sys

from .run import main

sys.exit(main())
