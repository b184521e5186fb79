"""`python -m pdserve.server`: one instance with the same flags as `pdserve instance`."""

from __future__ import annotations

import argparse
import sys

from pdserve.server.main import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.server", description="Serve one pdserve instance.")
    return run(add_arguments(parser).parse_args())


if __name__ == "__main__":  # guarded: a spawned engine process re-imports this module
    sys.exit(main())
