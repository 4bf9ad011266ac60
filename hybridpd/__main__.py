import sys

from hybridpd.cli import main

sys.exit(main())
