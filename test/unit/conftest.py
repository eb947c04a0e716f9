import pytest

from kimi_k2_neuron.testing.tiny_checkpoint import make_tiny


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """One tiny checkpoint per storage format, made once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {q: make_tiny(root / q, quant=q, shards=3, seed=0) for q in ("fp8", "int4", "bf16")}
