"""``python -m convserve.service serve ...``: the same as the ``convserve`` console script."""

import sys

from convserve.service.cli import main

# guarded: the engine and worker processes are spawned, and spawning imports the parent's main module again
if __name__ == "__main__":
    sys.exit(main())
