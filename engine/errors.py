"""Exceptions shared across the engine's modules."""


class Cancelled(Exception):
    """A cancel callback asked to stop; the session is valid at its last complete step."""
