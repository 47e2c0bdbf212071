import sys

from kvstrata.entrypoints.cli.main import main

sys.exit(main())
