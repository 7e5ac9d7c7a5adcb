"""Spark applications of deltaq (fanout, sweep); each is a thin ``main(argv) -> int``."""
