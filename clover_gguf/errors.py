"""The one exception type the CLI turns into a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, never a traceback."""

    exit_code = 2
