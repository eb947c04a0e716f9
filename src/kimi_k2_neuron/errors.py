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


def special_file(path) -> str | None:
    """What `path` is when it exists and is neither a regular file nor a folder ("a character device", "a FIFO",
    ...), else None. An output is written beside its path and renamed over it: over a device node, a FIFO or a
    socket, the rename would replace the node (as root, /dev/null itself), so outputs refuse them."""
    import os
    import stat

    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    for test, what in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return None


def env_int(name: str, default: int) -> int:
    """An integer environment variable (default when unset or empty); another value is one line naming it, where
    int() would raise a traceback from deep inside a build."""
    import os

    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise KimiInputError(f"environment variable {name}={value!r}: expected an integer") from None


def listing(names, limit: int = 4) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
