"""The one exception type the CLI turns into a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, never a traceback."""

    exit_code = 2


class SettingError(UserError):
    """A setting outside what the code takes; `name` says which (the server answers it as a 422 naming the field)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name
