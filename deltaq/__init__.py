"""The ``deltaq`` command."""
