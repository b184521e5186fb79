"""`python -m pdserve.bench serve|search|sweep|compare|plot|transfer` (the same as `pdserve bench ...`)."""

import sys

from pdserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
