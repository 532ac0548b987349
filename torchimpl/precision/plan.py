"""Precision resolution, autocast, TF32 and fp32 islands.

Rules:
1. ``resolve_precision`` follows the device/precision table exactly:

   ========  ===============================  =====  ======  ========
   device    request                          mode   scaler  autocast
   ========  ===============================  =====  ======  ========
   CUDA      auto, bf16 supported             bf16   no      yes
   CUDA      auto, bf16 unsupported           fp16   yes     yes
   CUDA      bf16, supported                  bf16   no      yes
   CUDA      bf16, unsupported or probe error fp32   no      no
   CUDA      fp16                             fp16   yes     yes
   CPU       auto                             fp32   no      no
   CPU       fp32                             fp32   no      no
   CPU       fp16                             fp32   no      no
   CPU       bf16                             bf16   no      yes
   MPS       auto, any mixed mode, fp32       fp32   no      no
   CPU       fp8                              fp8    no      yes (bf16, float8 emulated)
   CUDA      fp8, capability >= 8.9           fp8    no      yes (bf16)
   CUDA      fp8, capability < 8.9            bf16 (fp16 without bf16), downgraded
   CPU       bf16-true / fp16-true            same   no/yes  no (parameters in 16 bits)
   CUDA      bf16-true, bf16 supported        same   no      no
   CUDA      bf16-true, bf16 unsupported      fp32   no      no
   CUDA      fp16-true                        same   yes     no
   ========  ===============================  =====  ======  ========

   Mode ``auto`` consults ``PrecisionConfig.dtype`` (the preferred mixed dtype; ``auto`` with
   ``dtype="fp16"`` on CUDA gives fp16); other modes ignore it. ``fp32`` is fp32 everywhere.
   Any other device type is resolved like MPS.
2. CUDA bf16 support is ``torch.cuda.is_bf16_supported(including_emulation=False)``: native
   support only, because emulated bf16 on pre-Ampere GPUs is far slower than fp16. An exception
   from the probe counts as unsupported.
3. Every downgrade of an explicit request (CPU fp16 -> fp32, CUDA bf16 unsupported -> fp32, MPS or
   other devices mixed -> fp32) emits exactly one ``PrecisionDowngradeWarning`` and is kept in
   the plan's ``reason``; ``reason`` is None exactly when nothing was downgraded. Explicit CPU
   bf16 is kept without any hardware check.
4. Parameters and buffers stay fp32; autocast chooses the dtype per operation.
5. TF32 is set only through the ``fp32_precision`` attributes, never through ``allow_tf32``: torch
   raises "mix of the legacy and new APIs" when ``allow_tf32`` is read after ``fp32_precision``
   was set, so nothing here reads or writes ``allow_tf32``.
6. An fp32 island turns autocast off *and* needs its inputs upcast: with autocast off, an op on
   an fp16 tensor still runs in fp16 (``1 / (var + 1e-8)`` on an fp16 zero variance is inf, since
   1e-8 rounds to 0 in fp16).
7. ``fp8`` (``precision.fp8_recipe``: tensorwise, rowwise, rowwise_with_gw_hp, mxfp8) runs the
   eligible linear layers in float8 through torchao (``torchimpl.precision.fp8``) and the rest under bf16
   autocast, with no loss scaler. It needs torchao: without it resolution raises, naming the
   fix; so does a recipe the installed torch cannot run on the device (the rowwise recipes on
   torch 2.11's CPU: ``torchimpl.precision.fp8`` rule 5). The plan's ``note`` says what runs where (on a
   CPU: torch's float8 emulation, a correctness run, never a speed-up); mxfp8 below CUDA
   capability 10.0 is emulated too.
8. ``mode`` also takes the spellings of Lightning (``"bf16-mixed"``, ``"16-mixed"``, ``16``,
   ``"32-true"``, ...) and Accelerate (``"no"``), case-insensitively (:data:`SPELLINGS`). The
   config stores the canonical mode, so a spelled and a canonical precision compare equal; the
   spelling's meaning is logged at INFO and kept in ``spelling_note`` (config and plan).
   Spellings for recipes ampspec does not implement (``"64-true"``, ``"transformer-engine"``,
   ...) are refused with the reason and what to use instead.
9. ``bf16-true`` and ``fp16-true`` (Lightning's ``bf16-true``, ``16-true``) hold the parameters
   in 16 bits (``param_dtype``; the trainer casts the model and each batch's floating tensors,
   as Lightning's ``HalfPrecision`` does) and run no autocast; ``fp16-true`` takes a dynamic loss
   scaler on every device it runs on, since nothing is downgraded under it. They resolve as
   their dtype's mixed mode would: CPU and CUDA with native bf16 run them; bf16-true on a CUDA
   device without native bf16, and either on MPS or another device, is downgraded to fp32
   (rule 3). ``master_weights`` (none, fp32, kahan, stochastic) is carried to the plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchimpl.config.sections import DTYPES, MODES, REFUSED_SPELLINGS, SPELLINGS, PrecisionConfig, canonical_mode
from torchimpl.precision.fp8 import check_recipe, fp8_kernel, require_torchao

__all__ = [
    "MODES",
    "DTYPES",
    "REFUSED_SPELLINGS",
    "SPELLINGS",
    "PrecisionConfig",
    "PrecisionPlan",
    "PrecisionDowngradeWarning",
    "cuda_bf16_supported",
    "canonical_mode",
    "resolve_precision",
    "autocast_context",
    "configure_tf32",
    "tf32_settings",
    "configure_reduced_precision_reduction",
    "fp32_island",
    "upcast",
]

# fp8: the layers outside float8 run under bf16 autocast.
_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
               "bf16-true": torch.bfloat16, "fp16-true": torch.float16}
_TRUE_MODES = ("bf16-true", "fp16-true")


class PrecisionDowngradeWarning(UserWarning):
    """A requested precision could not be used on this device and a wider one was chosen."""


@dataclass(frozen=True)
class PrecisionPlan:
    """The resolved precision: ``mode`` in fp32|bf16|fp16|fp8, its torch ``dtype`` (autocast's;
    bf16 for fp8), whether a loss scaler and autocast are used, the device type it was resolved
    for, and ``reason`` (the downgrade message, or None when the request was honoured). fp8
    plans also carry ``fp8_recipe``, ``fp8_skip_first_last`` and ``note`` (what runs where)."""

    mode: str
    dtype: torch.dtype
    use_scaler: bool
    autocast_enabled: bool
    device_type: str
    reason: str | None = None
    fp8_recipe: str | None = None
    fp8_skip_first_last: bool = True
    note: str | None = None
    spelling_note: str | None = None
    """The config's ``spelling_note``: what the precision's spelling means (rule 8)."""
    master_weights: str = "none"
    """``precision.master_weights`` of a ``*-true`` plan (rule 9); ``none`` for every other."""

    @property
    def is_mixed_precision(self) -> bool:
        """True for bf16, fp16 and fp8 plans."""
        return self.mode in ("bf16", "fp16", "fp8")

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype the parameters are held in: ``dtype`` for a ``*-true`` plan, else float32."""
        return self.dtype if self.mode in _TRUE_MODES else torch.float32


def cuda_bf16_supported() -> bool:
    """Whether the current CUDA device supports bf16 natively (rule 2); any exception -> False."""
    try:
        probe = torch.cuda.is_bf16_supported
        try:
            native_only = "including_emulation" in inspect.signature(probe).parameters
        except (TypeError, ValueError):
            native_only = False
        return bool(probe(including_emulation=False) if native_only else probe())
    except Exception:  # noqa: BLE001 - the table says any probe error means "unsupported"
        return False


def _plan(mode: str, device_type: str, reason: str | None = None) -> PrecisionPlan:
    return PrecisionPlan(
        mode=mode,
        dtype=_TORCH_DTYPE[mode],
        use_scaler=mode in ("fp16", "fp16-true"),
        autocast_enabled=mode not in ("fp32",) + _TRUE_MODES,
        device_type=device_type,
        reason=reason,
    )


def _downgrade(device_type: str, reason: str) -> PrecisionPlan:
    warnings.warn(reason, PrecisionDowngradeWarning, stacklevel=4)
    return _plan("fp32", device_type, reason)


def resolve_precision(config: PrecisionConfig, device: str | torch.device) -> PrecisionPlan:
    """The plan for ``config`` on ``device``, per the table in rule 1 (warnings per rule 3)."""
    if not isinstance(config, PrecisionConfig):
        raise ValueError(f"config must be a PrecisionConfig, got {type(config).__name__}")
    plan = _resolve(config, device)
    if plan.mode in _TRUE_MODES:
        plan = dataclasses.replace(plan, master_weights=config.master_weights)
    if config.spelling_note is None:
        return plan
    return dataclasses.replace(plan, spelling_note=config.spelling_note)


def _resolve(config: PrecisionConfig, device: str | torch.device) -> PrecisionPlan:
    device_type = torch.device(device).type
    mode = config.mode
    if mode == "fp32":
        return _plan("fp32", device_type)
    if mode == "fp8":
        return _resolve_fp8(config, torch.device(device))
    if mode in _TRUE_MODES:
        return _resolve_true(mode, device_type)
    if device_type == "cuda":
        if mode == "fp16" or (mode == "auto" and config.dtype == "fp16"):
            return _plan("fp16", device_type)
        supported = cuda_bf16_supported()
        if mode == "auto":
            return _plan("bf16" if supported else "fp16", device_type)
        if supported:
            return _plan("bf16", device_type)
        return _downgrade(
            device_type,
            "precision mode 'bf16' was requested, but this CUDA device does not support bf16 "
            "natively (or the support probe failed): running in fp32; "
            "use mode 'fp16' (with a loss scaler) or 'auto' for mixed precision",
        )
    if device_type == "cpu":
        if mode == "bf16":
            return _plan("bf16", device_type)
        if mode == "fp16":
            return _downgrade(
                device_type,
                "precision mode 'fp16' was requested on the CPU, which this package does not "
                "train in: running in fp32; use mode 'bf16' for CPU mixed precision",
            )
        return _plan("fp32", device_type)
    if mode == "auto":
        return _plan("fp32", device_type)
    return _downgrade(
        device_type,
        f"precision mode {mode!r} was requested on {device_type}, where mixed precision is not "
        "supported by this package: running in fp32; use mode 'fp32' to silence this warning",
    )


def _resolve_true(mode: str, device_type: str) -> PrecisionPlan:
    """Rule 9: parameters in 16 bits where their dtype runs, else fp32 with the downgrade's warning."""
    if device_type == "cpu" or (device_type == "cuda" and (mode == "fp16-true" or cuda_bf16_supported())):
        return _plan(mode, device_type)
    why = ("this CUDA device does not support bf16 natively (or the support probe failed)" if device_type == "cuda"
           else f"parameters held in 16 bits are not supported on {device_type} by this package")
    return _downgrade(device_type, f"precision mode {mode!r} was requested, but {why}: running in fp32; "
                                   "use mode 'fp32' to silence this warning")


def _resolve_fp8(config: PrecisionConfig, device: torch.device) -> PrecisionPlan:
    """Rule 7: fp8 where float8 can run, else the table's downgrade for mixed precision."""
    require_torchao()
    check_recipe(config.fp8_recipe, device)  # refused, not downgraded: a recipe is the user's numerics
    why_not, note = fp8_kernel(config.fp8_recipe, device)
    if why_not is None:
        return PrecisionPlan("fp8", torch.bfloat16, False, True, device.type, None, config.fp8_recipe,
                             config.fp8_skip_first_last, note)
    if device.type == "cuda":
        fallback = "bf16" if cuda_bf16_supported() else "fp16"
        reason = f"precision mode 'fp8' was requested, but {why_not}: running in {fallback}"
        warnings.warn(reason, PrecisionDowngradeWarning, stacklevel=4)
        return _plan(fallback, device.type, reason)
    return _downgrade(device.type, f"precision mode 'fp8' was requested, but {why_not}: running in fp32; "
                                   "use mode 'fp32' to silence this warning")


def autocast_context(
    plan: PrecisionPlan, device: str | torch.device | None = None
) -> contextlib.AbstractContextManager[Any]:
    """``nullcontext()`` for an fp32 plan, else ``torch.autocast(plan.device_type,
    dtype=plan.dtype)``. ``device``, when given, must have the plan's device type (a plan
    resolved for one device type used on another is a bug worth stopping at)."""
    if device is not None and torch.device(device).type != plan.device_type:
        raise ValueError(
            f"device {str(device)!r} does not match the plan's device type "
            f"{plan.device_type!r}; resolve the precision for the device you run on"
        )
    if not plan.autocast_enabled:
        return contextlib.nullcontext()
    return torch.autocast(plan.device_type, dtype=plan.dtype)


def _tf32_targets() -> list[tuple[str, Any]]:
    """(label, object holding ``fp32_precision``) for each switch ``configure_tf32`` writes."""
    out: list[tuple[str, Any]] = []
    cuda = getattr(torch.backends, "cuda", None)
    cudnn = getattr(torch.backends, "cudnn", None)
    out.append(("cuda.matmul", getattr(cuda, "matmul", None)))
    out.append(("cudnn.conv", getattr(cudnn, "conv", None)))
    return out


def _get_precision(owner: Any) -> str | None:
    if owner is None:
        return None
    try:
        return str(owner.fp32_precision)
    except AttributeError:
        return None


def configure_tf32(enabled: bool) -> dict[str, str | None]:
    """Allow (``"tf32"``) or forbid (``"ieee"``) TF32 for CUDA matmuls and cuDNN convolutions,
    through ``torch.backends.cuda.matmul.fp32_precision`` and
    ``torch.backends.cudnn.conv.fp32_precision`` only (rule 5). Returns ``tf32_settings()``.

    The generic ``torch.backends.fp32_precision`` is reported but not written: it is the default
    of every backend left at ``"none"``, oneDNN on the CPU included, so writing it would change
    CPU numerics. Raises ``RuntimeError`` on a torch without the ``fp32_precision`` API.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be a bool, got {enabled!r}")
    value = "tf32" if enabled else "ieee"
    for label, owner in _tf32_targets():
        if _get_precision(owner) is None:
            raise RuntimeError(
                f"torch {torch.__version__} has no torch.backends.{label}.fp32_precision; "
                "TF32 is configured only through that API (torch >= 2.9)"
            )
    for _, owner in _tf32_targets():
        owner.fp32_precision = value
    return tf32_settings()


def tf32_settings() -> dict[str, str | None]:
    """The current ``fp32_precision`` values (None where this torch lacks the attribute):
    keys ``generic``, ``cuda.matmul``, ``cudnn.conv``. Never touches ``allow_tf32``."""
    out: dict[str, str | None] = {"generic": _get_precision(torch.backends)}
    for label, owner in _tf32_targets():
        out[label] = _get_precision(owner)
    return out


def configure_reduced_precision_reduction(
    fp16: bool | None = None, bf16: bool | None = None
) -> dict[str, bool]:
    """Set whether CUDA fp16 / bf16 GEMMs may use reduced-precision reductions
    (``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction`` and
    ``allow_bf16_reduced_precision_reduction``); None leaves a switch as it is. Returns the
    current values as ``{"fp16": bool, "bf16": bool}``."""
    for name, value in (("fp16", fp16), ("bf16", bf16)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool or None, got {value!r}")
    matmul = torch.backends.cuda.matmul
    if fp16 is not None:
        matmul.allow_fp16_reduced_precision_reduction = fp16
    if bf16 is not None:
        matmul.allow_bf16_reduced_precision_reduction = bf16
    return {
        "fp16": _as_bool(matmul.allow_fp16_reduced_precision_reduction),
        "bf16": _as_bool(matmul.allow_bf16_reduced_precision_reduction),
    }


def _as_bool(value: Any) -> bool:
    # Some torch versions report (allow, allow_splitk) as a tuple.
    if isinstance(value, tuple):
        return bool(value[0])
    return bool(value)


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


@contextlib.contextmanager
def fp32_island() -> Iterator[None]:
    """Disable autocast for every device type on which it is currently enabled.

    Inputs that are already fp16/bf16 stay so: pass them through ``upcast`` inside the island.
    """
    with contextlib.ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if not torch.amp.is_autocast_available(device_type):
                continue
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def upcast(*tensors: Any) -> Any:
    """Floating tensors narrower than 32 bits (fp16, bf16, float8) as float32; everything else
    (float32/64, integer, bool, complex tensors and non-tensors) unchanged. One argument returns
    one value, several return a tuple."""
    out = tuple(
        t.float()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() < 4
        else t
        for t in tensors
    )
    return out[0] if len(out) == 1 else out
