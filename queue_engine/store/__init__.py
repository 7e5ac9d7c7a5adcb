"""Delta I/O: the only package that imports deltalake."""
