"""Whether this tier runs here (conftest.py leaves every other module out when NxD/NxDI do not import)."""

import pytest


def test_nxd_and_nxdi_import(tier_reason):
    if tier_reason:
        pytest.skip(tier_reason)
    import neuronx_distributed  # noqa: F401
    import neuronx_distributed_inference  # noqa: F401
