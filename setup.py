"""Everything but the one C extension lives in setup.cfg (setuptools reads ext_modules only from here)."""

from setuptools import Extension, setup

# optional: where it does not build (no C compiler), the converter runs the same steps in torch, ~1.6x the CPU time
setup(ext_modules=[Extension("kimi_k2_neuron.quant._fp8_bytes", ["src/kimi_k2_neuron/quant/_fp8_bytes.c"],
                             extra_compile_args=["-O3"], optional=True)])
