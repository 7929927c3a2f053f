class SageGRPOError(Exception):
    """A user error: the message says what to change."""
