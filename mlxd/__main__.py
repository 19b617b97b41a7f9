import sys

from mlxd.cli import main

sys.exit(main())
