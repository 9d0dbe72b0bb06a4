"""`python -m fleetd.server`: the same as the `fleetd` console script."""

import sys

from fleetd.server.main import main

sys.exit(main())
