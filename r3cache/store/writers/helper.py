"""Entry point of the writer helper process: ``python -m r3cache.store.writers.helper FD``.

A module of its own, which the package never imports, so that running it as
``__main__`` does not load a second copy of ``r3cache.store.writers.process``.
"""

import os
import sys
from multiprocessing.connection import Connection

from r3cache.store.writers.process import _serve

if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
    # Everything the helper owed is done (holds dropped, replies sent): skip the
    # interpreter's teardown, which the engine's close() would otherwise wait for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
