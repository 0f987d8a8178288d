"""`pg.capturing()`: lets model code know it is running under graph capture."""
from __future__ import annotations

import threading
from contextlib import contextmanager

_local = threading.local()


def capturing() -> bool:
    """True while a backend captures (or warms up for capturing) a program's body."""
    return getattr(_local, "depth", 0) > 0


@contextmanager
def capture_scope():
    """Backends wrap warm-up and capture in this; restored on exit, exception or not."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
