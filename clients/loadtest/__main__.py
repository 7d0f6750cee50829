import sys

from clients.loadtest.cli import main

sys.exit(main())
