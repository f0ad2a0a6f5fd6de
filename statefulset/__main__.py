"""``python -m statefulset``: the command line (:mod:`statefulset.tools.cli`)."""

import sys

from statefulset.tools.cli import main

sys.exit(main())
