"""Build hook: the wheel carries prebuilt kernels.

`build_py` runs build_ptx.py into the build folder, so every wheel holds a cubin per
supported architecture, forward-compatible PTX and a manifest.  Editable installs skip
it (they compile at run time, cached), as does DRVSOFTMAX_NO_PREBUILT=1.
"""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("DRVSOFTMAX_NO_PREBUILT"):
            return
        out = os.path.join(self.build_lib, "drvsoftmax", "_prebuilt")
        subprocess.check_call([sys.executable, os.path.join(HERE, "build_ptx.py"), "--out", out])


setup(cmdclass={"build_py": BuildPyWithKernels})
