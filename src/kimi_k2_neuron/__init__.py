"""Kimi-K2 for AWS Trainium2: a backend-neutral PyTorch core plus a thin NxDI shell (kimi_k2_neuron.neuron)."""


def _version() -> str:
    """The installed distribution's version; from a source tree that is not installed, setup.cfg's (the one place
    the version is written)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kimi-k2-neuron")
    except PackageNotFoundError:
        import configparser
        from pathlib import Path

        cfg = configparser.ConfigParser()
        cfg.read(Path(__file__).resolve().parents[2] / "setup.cfg")
        return cfg.get("metadata", "version", fallback="0+unknown")


__version__ = _version()
