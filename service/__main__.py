"""``python -m convserve.service serve ...``: the same as the ``convserve`` console script."""

import sys

from convserve.service.cli import main

sys.exit(main())
