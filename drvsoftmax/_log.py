"""The ``drvsoftmax`` logger: loader decisions and run-time compiles.

Silent by default (a NullHandler); ``logging.basicConfig(level=logging.INFO)`` or
``logging.getLogger("drvsoftmax").setLevel(logging.DEBUG)`` with a handler shows it.
INFO: where each kernel was loaded from, every NVRTC compile with its duration, cache
problems.  DEBUG: every step of the fallback chain, cache hits, locks.
"""

from __future__ import annotations

import logging

log = logging.getLogger("drvsoftmax")
log.addHandler(logging.NullHandler())
