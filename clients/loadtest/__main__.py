import sys

from convserve.clients.loadtest.cli import main

sys.exit(main())
