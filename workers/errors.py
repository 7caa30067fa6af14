"""Errors shared by workers and orchestrator.

`BadInput` is the user's mistake (a missing model, an out-of-range parameter, an unknown chip): the
CLI turns it into one line on stderr and exit code 2, before anything is written.
"""


class FleettuneError(Exception):
    """Base class for errors fleettune reports as one line."""


class BadInput(FleettuneError):
    """The input cannot be used as given; nothing has been written."""
