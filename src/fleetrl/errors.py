"""The one exception type the CLI turns into a single-line error (no traceback unless --debug), and
how an exception from elsewhere is quoted in one (`one_line`)."""


class FleetrlError(Exception):
    """A failure the user can act on; the message names the field, file, worker or request."""


def one_line(e: BaseException) -> str:
    """An exception as `Type: first line of its message`; the full traceback stays chained."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
