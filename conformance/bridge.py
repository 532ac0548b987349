"""Moving arrays between NumPy/ml_dtypes and torch without changing a single bit.

NumPy has no bfloat16 or float8 of its own and torch has no ml_dtypes: both sides agree only on
the raw bits. Every conversion here goes through a same-width unsigned integer view, so NaN
payloads, signed zeros and subnormals arrive exactly as they left.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

# numpy/ml_dtypes dtype name -> torch dtype, for every format both libraries have.
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu") and hasattr(ml_dtypes, "float8_e8m0fnu"):
    _TORCH_DTYPES["float8_e8m0fnu"] = torch.float8_e8m0fnu

_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {
    tdt: np.dtype(getattr(ml_dtypes, name, None) or name) for name, tdt in _TORCH_DTYPES.items()
}
# Same-width integer views that both libraries support.
_INT_VIEW = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def torch_dtype(np_dtype: np.dtype | type | str) -> torch.dtype:
    """The torch dtype with the same format as a NumPy/ml_dtypes dtype."""
    name = np.dtype(np_dtype).name
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"no torch dtype for {name!r}; known: {sorted(_TORCH_DTYPES)}") from None


def numpy_dtype(t_dtype: torch.dtype) -> np.dtype:
    """The NumPy/ml_dtypes dtype with the same format as a torch dtype."""
    try:
        return _NUMPY_DTYPES[t_dtype]
    except KeyError:
        raise ValueError(f"no NumPy dtype for {t_dtype}; known: {sorted(map(str, _NUMPY_DTYPES))}") from None


def to_torch(x: np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
    """A torch tensor with exactly the bits of ``x`` (any floating format both sides know)."""
    x = np.asarray(x)
    target = torch_dtype(x.dtype)
    # np.array(order="C") keeps 0-d arrays 0-d, unlike np.ascontiguousarray.
    raw = torch.from_numpy(np.array(x.view(_INT_VIEW[x.dtype.itemsize]), order="C", copy=True))
    return raw.view(target).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy/ml_dtypes array with exactly the bits of ``t`` (moved to the CPU first)."""
    t = t.detach().to("cpu").contiguous()
    target = numpy_dtype(t.dtype)
    torch_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[target.itemsize]
    return t.view(torch_int).numpy().view(target).copy()
