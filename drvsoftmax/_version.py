"""The package version, read by ``pyproject.toml`` (setuptools dynamic metadata) and ``drvsoftmax.__version__``."""

__version__ = "0.1.0"
