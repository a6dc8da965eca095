"""The one exception type the CLI turns into a single-line error (no traceback unless --debug)."""


class FleetrlError(Exception):
    """A failure the user can act on; the message names the field, file, worker or request."""
