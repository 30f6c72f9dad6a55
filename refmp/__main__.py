"""``python -m refmp`` is the ``refmp`` command."""

import sys

from refmp.cli.main import main

sys.exit(main())
