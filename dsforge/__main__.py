"""`python -m dsforge` and the `dsforge` console script.

The CLI is imported inside ``main``, so Ctrl-C while Python is still loading it (click, the
compiler) exits 130 without a traceback, as it does during a command.
"""

import sys
from typing import NoReturn

from dsforge.interrupts import catch_sigterm, exit_code


def main() -> NoReturn:
    """Run the dsforge command line; an interrupt during start-up exits with 128 + its signal, quietly."""
    try:
        catch_sigterm()
        from dsforge.cli import main as cli_main

        cli_main()
    except KeyboardInterrupt as exc:
        sys.exit(exit_code(exc))


if __name__ == "__main__":
    main()
