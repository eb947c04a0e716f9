"""Bad user input, in one line naming what and what was expected, so the CLI prints it without a traceback."""


class KimiInputError(ValueError):
    """Bad input (a file, tensor, config field or argument); the message says which and what was expected."""


def listing(names, limit: int = 4) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
