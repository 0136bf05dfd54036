"""The one exception type the CLI turns into a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, never a traceback."""

    exit_code = 2


class SettingError(UserError):
    """A setting outside what the code takes; `name` says which (the server answers it as a 422 naming the field)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


class ContextOverflow(UserError):
    """A request whose prompt (with what it must generate) does not fit the context: the prompt's tokens
    (n_prompt_tokens; a lower bound when `at_least`) and the context's size (n_ctx), which the server's refusal
    carries as llama-server's does."""

    def __init__(self, message: str, n_prompt_tokens: int, n_ctx: int, at_least: bool = False):
        super().__init__(message)
        self.n_prompt_tokens, self.n_ctx, self.at_least = n_prompt_tokens, n_ctx, at_least
