"""``python -m refmp`` is the ``refmp`` command."""

import sys

from refmp.cli import main

sys.exit(main())
