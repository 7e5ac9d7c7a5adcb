"""deltaq's HTTP API (FastAPI): routes translate HTTP <-> queue_engine calls, nothing more."""
