"""Build hook: the wheel carries prebuilt kernels.

`build_py` runs build_ptx.py into the build folder, so a wheel holds cubins of the packaged
kernels for every architecture of ``drvsoftmax._compiler.ARCHS``, per-kernel PTX and a
manifest.  DRVSOFTMAX_ARCHS (or ``-C archs=...``, see _build_backend.py) limits the cubins
of a source build: ``native`` (this machine's GPUs; none without one), or a list such as
``"sm_90 sm_120"``.  Editable installs skip the build (they compile at run time, cached),
as does DRVSOFTMAX_NO_PREBUILT=1.
"""

import os
import subprocess
import sys
import time

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("DRVSOFTMAX_NO_PREBUILT", "") not in ("", "0"):
            return
        out = os.path.join(self.build_lib, "drvsoftmax", "_prebuilt")
        archs = os.environ.get("DRVSOFTMAX_ARCHS", "").replace(",", " ").split() or ["all"]
        t = time.perf_counter()
        subprocess.check_call([sys.executable, os.path.join(HERE, "build_ptx.py"), "--out", out, "--arch", *archs])
        print(f"drvsoftmax: kernels built in {time.perf_counter() - t:.0f} s (--arch {' '.join(archs)})", flush=True)


setup(cmdclass={"build_py": BuildPyWithKernels})
