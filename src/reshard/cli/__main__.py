"""``python -m reshard.cli`` is ``python -m reshard``: the signal handlers come before any heavy import.

Python imported this package before running this file, before any handler existed; it is
forgotten here, so that ``reshard.entry`` imports it again after installing them, exactly as the
console script does (an interrupt while it loads is then one line, as everywhere else).
"""

import runpy
import sys

import reshard

for _name in [n for n in sys.modules if n == "reshard.cli" or n.startswith("reshard.cli.")]:
    del sys.modules[_name]
if "cli" in vars(reshard):
    delattr(reshard, "cli")
runpy.run_module("reshard", run_name="__main__")  # reshard.entry ends the process
