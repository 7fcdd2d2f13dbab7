"""``python -m shardsafe``: the ``shardsafe`` command (see :mod:`shardsafe.cli`)."""

import sys

from shardsafe.cli import main

sys.exit(main())
