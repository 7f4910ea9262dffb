"""Exceptions, and the one helper that turns cuda.bindings result tuples into values."""

from __future__ import annotations

from typing import Any


class DrvSoftmaxError(Exception):
    """Base class of every exception drvsoftmax raises on purpose."""


class ArgumentTypeError(DrvSoftmaxError, TypeError):
    """An argument has the wrong type or dtype."""


class ArgumentValueError(DrvSoftmaxError, ValueError):
    """An argument has the right type but an unusable value (shape, device, range)."""


class CudaDriverError(DrvSoftmaxError, RuntimeError):
    """A CUDA driver call failed. ``name`` is the ``CUDA_ERROR_*`` name."""

    def __init__(self, call: str, code: int, name: str, description: str) -> None:
        self.call, self.code, self.name, self.description = call, code, name, description
        super().__init__(f"{call} failed: {name} ({code}): {description}")

    def __reduce__(self) -> tuple[Any, ...]:  # picklable: raised in worker processes too
        return (type(self), (self.call, self.code, self.name, self.description))


class NvrtcError(DrvSoftmaxError, RuntimeError):
    """NVRTC failed. Carries the compile log and the NVRTC version."""

    def __init__(self, call: str, name: str, log: str = "", version: str = "?") -> None:
        self.call, self.name, self.log, self.version = call, name, log, version
        msg = f"{call} failed: {name} (NVRTC {version})"
        if log:
            msg += "\n--- NVRTC log ---\n" + log.rstrip()
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable: precompile's worker processes raise it
        return (type(self), (self.call, self.name, self.log, self.version))


class KernelUnavailableError(DrvSoftmaxError, RuntimeError):
    """No kernel image could be loaded; the message lists every step tried."""


def arg_type_error(name: str, expected: str, got: object) -> ArgumentTypeError:
    return ArgumentTypeError(f"{name} must be {expected}, got {got}")


def arg_value_error(name: str, expected: str, got: object) -> ArgumentValueError:
    return ArgumentValueError(f"{name} must be {expected}, got {got}")


def _driver_error_text(code: Any) -> tuple[str, str]:
    from cuda.bindings import driver

    name, desc = "CUDA_ERROR_UNKNOWN", ""
    try:
        err, s = driver.cuGetErrorName(code)
        if int(err) == 0 and s:
            name = s.decode() if isinstance(s, bytes) else str(s)
        err, s = driver.cuGetErrorString(code)
        if int(err) == 0 and s:
            desc = s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # the driver itself may be what is missing
        name = str(getattr(code, "name", name))
    return name, desc


def check(result: Any, call: str = "CUDA call") -> Any:
    """Return the value(s) of a cuda.bindings call, or raise on a failing status.

    Every cuda.bindings function returns ``(status, *values)``.  This is the one place
    that knows it: driver statuses become :class:`CudaDriverError`, NVRTC statuses
    :class:`NvrtcError`.  Returns None, the single value, or a tuple of values.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err, values = result[0], result[1:]
    code = int(err)
    if code != 0:
        mod = type(err).__module__ or ""
        if "nvrtc" in mod:
            from . import _compiler

            raise NvrtcError(call, getattr(err, "name", str(code)), "", _compiler.nvrtc_version_str())
        name, desc = _driver_error_text(err)
        raise CudaDriverError(call, code, name, desc)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return values
