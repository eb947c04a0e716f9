"""Bad user input, in one line naming what and what was expected, so the CLI prints it without a traceback."""


class KimiInputError(ValueError):
    """Bad input (a file, tensor, config field or argument); the message says which and what was expected."""


class MissingConfig(KimiInputError):
    """A checkpoint folder without its config.json. `folder`: that folder, where an entry point may find more to say
    (an unfinished conversion: convert/resume.py); None for a config file named directly."""

    def __init__(self, message: str, folder=None):
        super().__init__(message)
        self.folder = folder


def broken_link(path) -> str | None:
    """What is wrong with `path` if it is a symbolic link that leads nowhere ("a symbolic link loop", "a symbolic
    link to T, which does not exist"), else None; os.stat's ELOOP and ENOENT would otherwise surface as a missing
    file or a traceback (Path.resolve raises RuntimeError on a loop before Python 3.13)."""
    import errno
    import os

    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno == errno.ENOENT:
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        return None


def listing(names, limit: int = 4) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
