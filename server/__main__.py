"""``python -m server serve ...`` is ``mlaserve serve ...``."""

import sys

from server.cli import main

sys.exit(main())
