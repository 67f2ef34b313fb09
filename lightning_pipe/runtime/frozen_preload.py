"""Imported last by this package's forkserver (:data:`lightning_pipe.runtime.launch.PRELOADED`): the
objects the server's imports made are frozen (:func:`gc.freeze`) before it forks any process.

A process forked from the server then never walks them in a garbage collection (with torch and
Lightning imported, some 500,000 objects: about 0.3 s a full collection on a CPU here), and their
memory stays shared with the server instead of being copied page by page as collections touch it;
Python's documentation of :func:`gc.freeze` recommends it before a fork for both reasons. The
executor's aligned collections leave such a frozen heap as it is
(:class:`~lightning_pipe.runtime.garbage.AlignedCollection`). Importing this module anywhere else
would freeze that process's objects of the moment: nothing in the package imports it.
"""

import gc

gc.collect()
gc.freeze()
