"""``python tests/interpreted_script.py SCRIPT ARGS...``: run SCRIPT as ``__main__`` with ARGS,
under the interpreter with the suite's settings (interpreter_patching.configure), as conftest
gives the test process and distributed.py every gloo rank. For the launch scripts that a test
runs under torchrun: its ranks' kernels then cost what the other tests' kernels cost (about
half of what Triton's interpreter takes on its own)."""

import os
import runpy
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_patching

    interpreter_patching.configure()

script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` has it
runpy.run_path(script, run_name="__main__")
