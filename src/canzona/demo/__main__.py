"""``python -m canzona.demo``: the same as ``canzona demo``."""

import sys

from canzona.demo import main

sys.exit(main())
