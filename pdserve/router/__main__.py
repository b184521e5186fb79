"""`python -m pdserve.router --prefill URL ... --decode URL ...`"""

import argparse
import sys

from pdserve.router.main import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="pdserve router", description="OpenAI-compatible PD router")
    return run(add_arguments(parser).parse_args())


if __name__ == "__main__":
    sys.exit(main())
