"""The ``rknpu`` command."""
