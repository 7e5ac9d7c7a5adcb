"""NSQ client programs run as child processes by the tests (each client's own event loop:
tornado for pynsq, gevent for gnsq, kept out of pytest's process)."""
