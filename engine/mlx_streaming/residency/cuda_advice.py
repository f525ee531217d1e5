"""CUDA memory advice for host buffers the GPU reads in place, through the CUDA driver (``ctypes``; no dependency).

MLX's CUDA backend allocates managed memory: an array the host writes through a NumPy view is paged to the host,
and the next kernel that reads it faults the pages back to the device, a migration per write. Advised to stay in
host memory (preferred location: the host) and to be mapped for the device (accessed by: the GPU), the pages stay
where the host writes them and a copy kernel reads them over the bus, with no migration. Where there is no CUDA
driver (macOS, a CPU backend) or the driver refuses the advice (memory it did not allocate), nothing is advised.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

#: ``CUmem_advise`` and ``CUmemLocationType`` values (cuda.h).
_SET_PREFERRED_LOCATION, _SET_ACCESSED_BY = 3, 5
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


@functools.lru_cache(maxsize=None)
def _advise_call() -> Optional[Callable[..., int]]:
    """The driver's ``cuMemAdvise_v2``, or None where no CUDA driver is loaded."""
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            call = ctypes.CDLL(name).cuMemAdvise_v2
        except (OSError, AttributeError):
            continue
        call.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        call.restype = ctypes.c_int
        return call
    return None


def advise_read_in_place(view: np.ndarray) -> bool:
    """Advise the managed memory under ``view`` to stay in host memory and be mapped for MLX's default GPU;
    whether the driver took both pieces of advice."""
    call = _advise_call()
    if call is None:
        return False
    device = int(str(mx.default_device()).rstrip(")").rsplit(",", 1)[-1])  # "Device(gpu, 0)": MLX names no ordinal
    pointer = view.__array_interface__["data"][0]
    return (call(pointer, view.nbytes, _SET_PREFERRED_LOCATION, _Location(_LOCATION_HOST, 0)) == 0
            and call(pointer, view.nbytes, _SET_ACCESSED_BY, _Location(_LOCATION_DEVICE, device)) == 0)
