"""deltaq's queue engine: NSQ semantics over Delta tables.

The pure modules (names, message, mpub, registry, errors, settings) do no I/O; ``store``'s
packages ``delta``, ``tables`` and ``upkeep`` are the only ones that import ``deltalake``;
``broker`` ties them together for the API.
"""

from __future__ import annotations

__version__ = "0.1.0"

# The nsqd version whose HTTP API and TCP protocol deltaq speaks; clients compare it, so it is
# nsqd's numbering.
NSQD_VERSION = "1.3.0"
