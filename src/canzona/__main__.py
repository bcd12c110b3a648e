"""``python -m canzona``: the same as the ``canzona`` command."""

import sys

from canzona.cli import main

sys.exit(main())
