"""`python -m clover_gguf` and the `clover-gguf` script (pyproject: run). Ctrl-C is handled from here on: the command
line's imports (numpy, typer, the decoders: a quarter second and more) come after the handler, so a Ctrl-C during
them is the one line and exit 130 of any other, not a KeyboardInterrupt traceback and a death by SIGINT."""

import os
import signal


def _interrupted_early(signum, frame) -> None:
    """Ctrl-C before cli.main is ready for it: nothing has been written yet, so there is nothing to remove."""
    os.write(2, b"clover-gguf: error: interrupted\n")
    os._exit(130)


_interrupted_early.clover_early = True  # cli.main puts Python's own handler back once its own handling is in place


def run() -> None:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not one the user chose to ignore
        signal.signal(signal.SIGINT, _interrupted_early)
    from clover_gguf.cli import main

    main()


if __name__ == "__main__":
    run()
