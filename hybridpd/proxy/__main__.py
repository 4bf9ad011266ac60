"""`python -m hybridpd.proxy`: the same as `hybridpd proxy`, without loading the other commands."""

import sys

from hybridpd.proxy.main import main

sys.exit(main())
