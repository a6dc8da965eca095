"""`python -m fleetrl` works like the `fleetrl` script."""

import sys

from fleetrl.cli import main

sys.exit(main())
