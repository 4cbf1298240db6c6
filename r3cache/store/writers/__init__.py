"""Writers that take puts off the engine thread: a thread (background), or a helper
process fed through a shared-memory ring (process, ring, helper); both bound every wait
(bounded)."""
