"""Spark glue: the only package (with jobs/) that imports pyspark."""
