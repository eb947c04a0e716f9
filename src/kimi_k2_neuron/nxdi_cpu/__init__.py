"""The CPU verification harness of the Neuron shell, not part of what runs on trn2: the NxDI model run by the real
NxD/NxDI in NxD's CPU mode (backend.py: `--backend nxdi-cpu`, the scripts' `--cpu`, the nxdi-cpu test tier) and
traced with torch_xla on its CPU device as ModelBuilder traces it (xla_trace.py: `trace-cpu`). Both need NxD and
NxDI importable; the shell they verify is kimi_k2_neuron.neuron."""
