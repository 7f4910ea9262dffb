"""Build backend: setuptools, plus one option for source builds.

    pip install . -C archs=native        # cubins for this machine's GPUs only (fast)
    pip install . -C archs="sm_90 sm_120"
    python -m build -C archs=all         # the default: every architecture of _compiler.ARCHS

The option sets DRVSOFTMAX_ARCHS, which setup.py hands to build_ptx.py (the variable
itself works too, with any front end).
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403  (every other hook unchanged)


def _apply(config_settings) -> None:
    archs = (config_settings or {}).get("archs")
    if archs is not None:
        os.environ["DRVSOFTMAX_ARCHS"] = " ".join(archs) if isinstance(archs, list) else str(archs)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _apply(config_settings)
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
