"""Run a command or script as from a shell, with one function made to pause inside its work: on the nth call of
`target` (module:Class.method or module:function) it says so (touches MARKER, or prints a line starting
"test pause: inside " to stderr when MARKER is "-") and sleeps, for the test to send its signal. A target ending in
save_file runs before pausing (the file fully written, not yet renamed). Used by test/unit/test_interrupts.py and
test/nxdi_cpu/test_script_interrupts.py:

    python test/pause_child.py MARKER TARGET N (kimi_k2_neuron.cli | path/to/script.py) ARG...
"""

import importlib
import os
import pathlib
import runpy
import sys
import time

marker, target, nth, what, *argv = sys.argv[1:]
module, _, attr = target.partition(":")
owner = importlib.import_module(module)
*path, name = attr.split(".")
for part in path:
    owner = getattr(owner, part)
original, calls = getattr(owner, name), [0]


def paused(*args, **kwargs):
    calls[0] += 1
    if calls[0] == int(nth):
        result = original(*args, **kwargs) if target.endswith("save_file") else None
        if marker == "-":  # the whole line in one write: a signal sent on its first bytes must not split it
            sys.stderr.flush()
            os.write(2, f"test pause: inside {target}\n".encode())
        else:
            pathlib.Path(marker).touch()
        time.sleep(300)
        return result
    return original(*args, **kwargs)


setattr(owner, name, paused)
sys.argv = [what, *argv]
if what.endswith(".py"):
    runpy.run_path(what, run_name="__main__")
else:
    runpy.run_module(what, run_name="__main__", alter_sys=True)
