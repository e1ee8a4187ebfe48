"""cudarecv's logger: ``logging.getLogger("cudarecv")``, silent unless the application configures it.

What it records: transport choices and fallbacks with their reason, receivers a weight sender
dropped, tuned settings, and failures of background threads (which also reach the caller's future
or call). Nothing is printed by default (a ``NullHandler``); to see it:

Example:
    >>> import logging
    >>> logging.basicConfig()
    >>> logging.getLogger("cudarecv").setLevel(logging.INFO)
"""

from __future__ import annotations

import logging

logger = logging.getLogger("cudarecv")
# its NullHandler is added in cudarecv/__init__.py, which runs first
