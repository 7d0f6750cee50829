"""``python -m service serve ...``: the same as the ``convserve`` console script."""

import sys

from service.cli import main

sys.exit(main())
