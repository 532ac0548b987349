"""Which precision a run gets, given its device and what was asked for.

Rules:

1. A request is a mode, ``auto``, ``fp32``, ``bf16`` or ``fp16``, plus a preferred dtype, ``bf16``
   or ``fp16``, that only ``auto`` consults.
2. The outcome is a mode (never ``auto``), the dtype autocast computes in (``float32``,
   ``bfloat16`` or ``float16``), whether a loss scaler is used and whether autocast is on.
   Parameters and buffers stay float32 in every case; fp32 means no autocast and no scaler.
3. A loss scaler goes with fp16 and only fp16: bf16 has float32's exponent range and needs none.
4. CUDA: ``auto`` takes the preferred dtype, except that bf16 on a device without bf16 becomes
   fp16. An explicit ``bf16`` on such a device (or when probing for bf16 failed) becomes fp32,
   not fp16, because fp16 brings a loss scaler nobody asked for. ``fp16`` and ``fp32`` are kept.
5. CPU: ``auto`` is fp32; ``bf16`` is kept (and not checked: CPU autocast supports it);
   ``fp16`` becomes fp32.
6. MPS: everything is fp32.
7. Whenever the outcome differs from an explicit request, or ``auto``'s preferred dtype is not
   used, the outcome carries a one-sentence reason; otherwise the reason is None. A caller must
   show it: a downgrade is never silent.
8. ``TABLE`` lists every case; ``resolve_precision`` finds the one row that matches.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_TYPES = ("cuda", "cpu", "mps")
MODES = ("auto", "fp32", "bf16", "fp16")
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Resolution:
    """What a run gets: ``mode`` in fp32/bf16/fp16, ``dtype`` a dtype name, and why if downgraded."""

    mode: str
    dtype: str
    use_scaler: bool
    autocast_enabled: bool
    reason: str | None


@dataclass(frozen=True)
class Row:
    """One case of the table. ``dtype`` and ``bf16_supported`` are None where they are not consulted."""

    device_type: str
    mode: str
    dtype: str | None
    bf16_supported: bool | None
    resolution: Resolution


_FP32 = Resolution("fp32", "float32", use_scaler=False, autocast_enabled=False, reason=None)
_BF16 = Resolution("bf16", "bfloat16", use_scaler=False, autocast_enabled=True, reason=None)
_FP16 = Resolution("fp16", "float16", use_scaler=True, autocast_enabled=True, reason=None)


def _because(base: Resolution, reason: str) -> Resolution:
    return Resolution(base.mode, base.dtype, base.use_scaler, base.autocast_enabled, reason)


_MPS_REASON = (
    "{asked} was requested on MPS, where this project does not run mixed precision (autocast and "
    "loss scaling there depend on the torch version); using fp32 without autocast."
)

TABLE: tuple[Row, ...] = (
    Row("cuda", "auto", "bf16", True, _BF16),
    Row("cuda", "auto", "bf16", False, _because(
        _FP16,
        "auto preferred bf16, but this CUDA device does not support bfloat16; "
        "using fp16 autocast with a loss scaler.",
    )),
    Row("cuda", "auto", "fp16", None, _FP16),
    Row("cuda", "fp32", None, None, _FP32),
    Row("cuda", "bf16", None, True, _BF16),
    Row("cuda", "bf16", None, False, _because(
        _FP32,
        "bf16 was requested, but this CUDA device does not support bfloat16 (or the check failed); "
        "using fp32 without autocast rather than fp16, which would need a loss scaler.",
    )),
    Row("cuda", "fp16", None, None, _FP16),
    Row("cpu", "auto", None, None, _FP32),
    Row("cpu", "fp32", None, None, _FP32),
    Row("cpu", "bf16", None, None, _BF16),
    Row("cpu", "fp16", None, None, _because(
        _FP32,
        "fp16 was requested on CPU, where this project does not use fp16 (it needs a loss scaler "
        "and most CPUs have no fast fp16 arithmetic; bf16 is the CPU mixed-precision mode); "
        "using fp32 without autocast.",
    )),
    Row("mps", "auto", None, None, _FP32),
    Row("mps", "fp32", None, None, _FP32),
    Row("mps", "bf16", None, None, _because(_FP32, _MPS_REASON.format(asked="bf16"))),
    Row("mps", "fp16", None, None, _because(_FP32, _MPS_REASON.format(asked="fp16"))),
)


def resolve_precision(
    device_type: str,
    mode: str,
    dtype: str = "bf16",
    bf16_supported: bool = True,
) -> Resolution:
    """The ``Resolution`` for a device type and a requested mode (rules 1-8), looked up in ``TABLE``.

    ``device_type`` is "cuda", "cpu" or "mps"; ``mode`` is "auto", "fp32", "bf16" or "fp16";
    ``dtype`` ("bf16" or "fp16") is consulted only when ``mode`` is "auto"; ``bf16_supported``
    is consulted only on CUDA (pass False when the probe for bf16 failed). Every argument is
    validated even where it is not consulted. Raises ``ValueError`` naming a bad argument.
    """
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {', '.join(DEVICE_TYPES)}, got {device_type!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(bf16_supported, bool):
        raise ValueError(f"bf16_supported must be a bool, got {bf16_supported!r}")
    matches = [
        row.resolution
        for row in TABLE
        if row.device_type == device_type
        and row.mode == mode
        and row.dtype in (None, dtype)
        and row.bf16_supported in (None, bf16_supported)
    ]
    # The table is complete and unambiguous (its tests check every combination), so exactly one.
    (resolution,) = matches
    return resolution
