"""cache.py: where the package keeps what it makes, as $KIMI_K2_NEURON_CACHE says."""

from __future__ import annotations

from kimi_k2_neuron.cache import ENV, cache_dir


def test_the_cache_folder_is_one_absolute_place(monkeypatch, tmp_path):
    """A blank value counts as unset (it made a folder named ' ' in the working folder); a quoted ~ is expanded (it
    made a folder named '~'); a relative path is made absolute, so every message names one place."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    default = tmp_path / "home" / ".cache" / "kimi-k2-neuron"
    for value, want in ((None, default), ("", default), ("  ", default), ("~/kc", tmp_path / "home" / "kc"),
                        ("rel", tmp_path / "rel"), (str(tmp_path / "abs"), tmp_path / "abs")):
        if value is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, value)
        assert cache_dir() == want, value
