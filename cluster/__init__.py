"""Composition root: configuration to running system, and the ``pdserve`` command line."""
