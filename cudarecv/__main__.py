"""``python -m cudarecv``: see :mod:`cudarecv.tools.cli`."""

import sys

from cudarecv.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
