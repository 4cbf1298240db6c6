"""Entry point of the writer helper process: ``python -m r3cache.store.helper FD``.

A module of its own, which the package never imports, so that running it as
``__main__`` does not load a second copy of ``r3cache.store.process``.
"""

import sys
from multiprocessing.connection import Connection

from r3cache.store.process import _serve

if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
