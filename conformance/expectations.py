"""Known, explained differences between torch and the specification, keyed by torch version.

A difference listed here is expected and tested as such; anything else is a failure. When torch
changes behaviour the keyed expectation fails loudly with the version, so the change is noticed
rather than absorbed.
"""

from __future__ import annotations

import torch

TORCH_VERSION = ".".join(torch.__version__.split("+")[0].split(".")[:2])

# float32/float16/bfloat16 -> float8_e4m3fn on overflow and ±inf. torch's CPU conversion started
# to saturate to ±448 with pytorch/pytorch#178817 (April 2026); before that it produced NaN, like
# ml_dtypes and the OFP8 non-saturating mode. Measured on CPU for the versions listed; other
# versions are probed and reported.
E4M3FN_SATURATES_ON_CPU: dict[str, bool] = {"2.13": True, "2.14": True}


def probe_e4m3fn_saturates(device: str) -> bool:
    """What the installed torch does on ``device``: does 1e6 -> float8_e4m3fn give 448?"""
    x = torch.tensor([1e6, float("inf")], device=device).to(torch.float8_e4m3fn).float().cpu()
    return bool(torch.equal(x, torch.tensor([448.0, 448.0])))


def e4m3fn_saturates(device: str) -> bool:
    """The saturation behaviour the suite expects on ``device`` with the installed torch."""
    if device == "cpu" and TORCH_VERSION in E4M3FN_SATURATES_ON_CPU:
        return E4M3FN_SATURATES_ON_CPU[TORCH_VERSION]
    # CUDA picks an intrinsic or the C++ path by toolkit and architecture: probed, not assumed.
    return probe_e4m3fn_saturates(device)


# Autocast op policy (reference.autocast.POLICY): the torch versions, per device type, whose output
# dtypes were compared op by op against the table and matched. The CPU table was measured on
# 2.13; the CUDA table follows PyTorch's documented lists and has not yet been run on a GPU. No
# version-dependent difference is known; one found later is keyed here by version, not absorbed.
AUTOCAST_POLICY_CONFIRMED: dict[str, tuple[str, ...]] = {"cpu": ("2.13",), "cuda": ()}


def autocast_policy_provenance(device: str) -> str:
    """One line for failure messages: which torch versions confirmed the table on ``device``."""
    confirmed = AUTOCAST_POLICY_CONFIRMED.get(device, ())
    if not confirmed:
        return f"the {device} table has not been confirmed on any torch version yet"
    return f"the {device} table was confirmed on torch {', '.join(confirmed)}"
