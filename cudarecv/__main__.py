"""``python -m cudarecv``: see :mod:`cudarecv.tools.cli`."""

import signal
import sys

from cudarecv.tools.cli import main

if __name__ == "__main__":
    status = main()
    # the command is over (a Ctrl-C during it is handled there): one now would only break the exit's own
    # clean-up (the ranks' zygote stopped at exit) with a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)
