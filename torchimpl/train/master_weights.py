"""Master weights: a torch optimizer stepping a model whose parameters are stored in bfloat16
or float16 (``precision.master_weights``), by the rules of ``reference/master_weights.py``.

S is the parameters' dtype. :class:`MasterWeights` wraps any torch optimizer built over the
model's S parameters; on an applied step the step engine calls :meth:`MasterWeights.step` in
place of ``optimizer.step()`` (after unscaling, checking and clipping the S gradients as
usual), and calls nothing on a skipped step, so that nothing changes then.

Rules:

1. ``none``: ``optimizer.step()`` on the S tensors; the state is torch's, in S.
2. ``fp32``: a float32 master per parameter (``f32(p)`` at the start) holds the weight; the
   optimizer steps it with float32 state and the parameter becomes its RNE cast to S. State the
   optimizer created with it (Adagrad's ``sum``, in S) is upcast to float32 once, exactly.
3. ``kahan`` and ``stochastic``: the optimizer steps float32 copies of the weights and of its
   state (the gradient upcast too); the copies live during the step only. The result ``q``
   gives the update ``u = q - f32(p)``; ``kahan`` adds it through a compensation buffer (S),
   ``stochastic`` (bfloat16 only) rounds ``q`` stochastically with 16 random bits per element
   drawn from a ``torch.Generator`` (torchao's ``_fp32_to_bf16_sr``). The state is stored back
   in S, but for the float32 counters (``step``, NAdam's ``mu_product``), as torch keeps it for
   an S parameter.
4. How the optimizer steps float32 values it holds as S parameters: for the step, each
   parameter's ``.data`` is swapped for the float32 tensor and its ``.grad`` for the upcast
   gradient; the parameter objects (the optimizer's state keys) stay the same, so every torch
   optimizer and implementation (for-loop, foreach, fused) runs unchanged.
5. Lost updates (``reference.health`` rule 12): an element's update was lost when its exact
   update (``m' - m`` for ``fp32``, ``u`` otherwise) is finite and non-zero and the stored bits
   did not change. Measured by default for ``fp32``, ``kahan`` and ``stochastic``; for ``none``
   only with ``measure_lost=True``, which evaluates the step a second time in float32.
6. ``state_dict`` holds the option, the storage dtype, the masters, the compensation buffers,
   the generator's state and the optimizer's state; ``load_state_dict`` refuses another option
   or dtype and restores every bit (torch's own ``Optimizer.load_state_dict`` would cast a
   float32 state to the S parameter's dtype).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["OPTIONS", "MasterWeights", "stochastic_round_bf16"]

OPTIONS = ("none", "fp32", "kahan", "stochastic")
_STORAGE = (torch.bfloat16, torch.float16)
# torch keeps these float32 for a parameter of any dtype (rule 3).
_SCALAR_STATE = frozenset({"step", "mu_product"})


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Rule 3: float32 ``x`` to bfloat16, away from zero where ``bits < low 16 bits of x``."""
    pattern = x.contiguous().view(torch.int32)
    truncated = pattern & -65536  # 0xFFFF0000 as an int32
    rounded = torch.where(bits < (pattern & 0xFFFF), truncated + 0x10000, truncated)
    return rounded.view(torch.float32).to(torch.bfloat16)


def _state_to(state: dict[str, Any], dtype: torch.dtype) -> None:
    """Every floating state tensor but the float32 counters to ``dtype``, in place of the dict."""
    for key, value in state.items():
        if key not in _SCALAR_STATE and isinstance(value, torch.Tensor) and value.is_floating_point():
            state[key] = value.to(dtype)


class MasterWeights:
    """One option (module docstring) over ``optimizer``, whose parameters are all bfloat16 or all
    float16. ``generator`` draws the stochastic option's bits (a fresh one seeded with
    ``torch.initial_seed()`` when None)."""

    def __init__(self, optimizer: torch.optim.Optimizer, option: str, *, generator: torch.Generator | None = None):
        if option not in OPTIONS:
            raise ValueError(f"precision.master_weights must be one of {', '.join(OPTIONS)}, got {option!r}")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            raise ValueError("the optimizer holds no parameters")
        dtype = params[0].dtype
        for i, p in enumerate(params):
            if p.dtype not in _STORAGE or p.dtype != dtype:
                raise ValueError(f"parameter {i} (shape {list(p.shape)}) is {p.dtype}: master weights need every "
                                 f"parameter in one of bfloat16, float16 (model.to(torch.bfloat16))")
        if option == "stochastic" and dtype != torch.bfloat16:
            raise ValueError(f"precision.master_weights: stochastic rounds to bfloat16 only, the parameters are {dtype}; "
                             "use fp32 or kahan")
        self.optimizer, self.option, self.dtype, self.params = optimizer, option, dtype, params
        with torch.no_grad():
            self.masters = [p.detach().float().clone() for p in params] if option == "fp32" else None
            if option == "fp32":  # state an optimizer built with it (Adagrad's sum) steps in float32 too
                for p in params:
                    if p in optimizer.state:
                        _state_to(optimizer.state[p], torch.float32)
            self.compensation = [torch.zeros_like(p) for p in params] if option == "kahan" else None
        if option == "stochastic" and generator is None:
            generator = torch.Generator(device=params[0].device).manual_seed(torch.initial_seed())
        self.generator = generator if option == "stochastic" else None
        self.last_bits: list[torch.Tensor | None] = []
        self._lost: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    # --- the step ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, *, bits: list[torch.Tensor | None] | None = None, measure_lost: bool | None = None) -> None:
        """One applied step (rules 1-5). ``bits`` (stochastic): one int32 tensor of values in
        [0, 2**16) per parameter, in the optimizer's order (None where there is no gradient);
        drawn from the generator when None."""
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if self.option == "stochastic" and bits is not None:
            self._check_bits(live, bits)  # before anything changes
        measure = self.option != "none" if measure_lost is None else measure_lost
        before = {i: self.params[i].detach().clone() for i in live} if measure else {}
        if self.option == "none":
            exact = self._none_exact(live) if measure else {}
            self.optimizer.step()
        elif self.option == "fp32":
            exact = self._fp32_step(live, measure)
        else:
            exact = self._float32_step(live, bits)
        # kahan and stochastic compute the exact update anyway; it is counted only when measured
        self._lost = [self._count(self.params[i], before[i], exact[i]) if i in exact and i in before else None
                      for i in range(len(self.params))]

    def _swap_in(self, live: list[int], values: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, Any]]:
        """Rule 4: parameters ``live`` hold ``values`` (float32) and upcast gradients."""
        saved = {}
        for i in live:
            p = self.params[i]
            saved[i] = (p.data, p.grad)
            p.grad = None
            p.data = values[i]
            p.grad = saved[i][1].float()
        return saved

    def _swap_out(self, saved: dict[int, tuple[torch.Tensor, Any]]) -> None:
        for i, (data, grad) in saved.items():
            p = self.params[i]
            p.grad = None
            p.data = data
            p.grad = grad

    def _fp32_step(self, live: list[int], measure: bool) -> dict[int, torch.Tensor]:
        """Rule 2: the masters step; the parameters become their RNE casts."""
        masters = self.masters
        old = {i: masters[i].clone() for i in live} if measure else {}
        saved = self._swap_in(live, {i: masters[i] for i in live})
        try:
            self.optimizer.step()
        finally:
            self._swap_out(saved)
        for i in live:
            self.params[i].copy_(masters[i])
        return {i: masters[i] - old[i] for i in old}

    def _float32_step(self, live: list[int], bits: list[torch.Tensor | None] | None) -> dict[int, torch.Tensor]:
        """Rule 3: the step on float32 copies, then the compensated or stochastic store."""
        start = {i: self.params[i].detach().float() for i in live}
        work = {i: start[i].clone() for i in live}
        states = self.optimizer.state
        for i in live:
            if self.params[i] in states:
                _state_to(states[self.params[i]], torch.float32)
        saved = self._swap_in(live, work)
        try:
            self.optimizer.step()
        finally:
            self._swap_out(saved)
            for i in live:
                _state_to(states[self.params[i]], self.dtype)
        exact = {i: work[i] - start[i] for i in live}
        if self.option == "kahan":
            for i in live:
                p, c = self.params[i], self.compensation[i]
                y = c.float() + exact[i]
                t = (start[i] + y).to(self.dtype)
                c.copy_((y - (t.float() - start[i])).to(self.dtype))
                p.copy_(t)
            return exact
        self.last_bits = self._bits(live, bits)
        for i in live:
            self.params[i].copy_(stochastic_round_bf16(work[i], self.last_bits[i]))
        return exact

    def _bits(self, live: list[int], bits: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        if bits is not None:
            return list(bits)
        return [torch.randint(0, 1 << 16, self.params[i].shape, dtype=torch.int32, device=self.params[i].device,
                              generator=self.generator) if i in live else None for i in range(len(self.params))]

    def _check_bits(self, live: list[int], bits: list[torch.Tensor | None]) -> None:
        if len(bits) != len(self.params):
            raise ValueError(f"bits: one tensor per parameter ({len(self.params)}), got {len(bits)}")
        for i in live:
            b = bits[i]
            if b is None or b.shape != self.params[i].shape or b.dtype != torch.int32:
                raise ValueError(f"bits[{i}] must be an int32 tensor of shape {list(self.params[i].shape)} "
                                 f"(values in [0, 2**16)), got {None if b is None else (b.dtype, list(b.shape))}")

    def _none_exact(self, live: list[int]) -> dict[int, torch.Tensor]:
        """Rule 5 for ``none``: the step evaluated in float32 on copies, leaving everything as it was."""
        states = self.optimizer.state
        kept = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in states[self.params[i]].items()}
                for i in live if self.params[i] in states}
        start = {i: self.params[i].detach().float() for i in live}
        work = {i: start[i].clone() for i in live}
        for i in kept:
            _state_to(states[self.params[i]], torch.float32)
        saved = self._swap_in(live, work)
        try:
            self.optimizer.step()
        finally:
            self._swap_out(saved)
            for i in live:
                if i in kept:
                    states[self.params[i]] = kept[i]
                else:
                    states.pop(self.params[i], None)
        return {i: work[i] - start[i] for i in live}

    @staticmethod
    def _count(p: torch.Tensor, before: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rule 5 on the device: (lost, counted)."""
        counted = torch.isfinite(exact) & (exact != 0)
        same = before.view(torch.int16) == p.detach().view(torch.int16)
        return (counted & same).sum(), counted.sum()

    # --- what a step leaves ----------------------------------------------------------------

    def lost_counts(self) -> list[tuple[int, int] | None]:
        """Per parameter of the last step: (lost, counted), None where nothing was measured (a host sync)."""
        return [None if x is None else (int(x[0]), int(x[1])) for x in self._lost]

    def lost_fraction(self) -> float:
        """Of every counted element of the last step, the fraction lost (0.0 when none counted)."""
        pairs = [x for x in self.lost_counts() if x is not None]
        counted = sum(c for _, c in pairs)
        return sum(lost for lost, _ in pairs) / counted if counted else 0.0

    def bytes_held(self) -> int:
        """The bytes of the weights, masters, compensation buffers and optimizer state (no gradients)."""
        tensors = list(self.params) + list(self.masters or []) + list(self.compensation or [])
        for p in self.params:
            tensors += [v for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_per_parameter(self) -> float:
        numel = sum(p.numel() for p in self.params)
        return self.bytes_held() / numel if numel else 0.0

    # --- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Rule 6."""
        return {"option": self.option, "storage_dtype": str(self.dtype).removeprefix("torch."),
                "masters": self.masters, "compensation": self.compensation,
                "generator": None if self.generator is None else self.generator.get_state(),
                "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rule 6: refuses another option or storage dtype before changing anything."""
        saved, here = state.get("option"), str(self.dtype).removeprefix("torch.")
        if saved != self.option:
            raise ValueError(f"the checkpoint was saved with precision.master_weights={saved!r} but this run uses "
                             f"{self.option!r}: resume with master_weights={saved!r}, or start a new run")
        if state.get("storage_dtype") != here:
            raise ValueError(f"the checkpoint's parameters were stored in {state.get('storage_dtype')} but this "
                             f"run's are {here}: set precision.mode to the checkpoint's")
        for name in ("masters", "compensation"):
            mine, theirs = getattr(self, name), state.get(name)
            if (mine is None) != (theirs is None) or (mine is not None and len(mine) != len(theirs)):
                raise ValueError(f"the checkpoint's {name} do not match this optimizer's {len(self.params)} parameters")
        if self.masters is not None:
            for m, s in zip(self.masters, state["masters"]):
                m.copy_(s)
        if self.compensation is not None:
            for c, s in zip(self.compensation, state["compensation"]):
                c.copy_(s)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])
        # Loaded against float32 stand-ins, so that torch casts no float32 state to S ...
        everyone = list(range(len(self.params)))
        values = {i: (self.masters[i] if self.masters is not None else self.params[i].detach().float())
                  for i in everyone}
        kept = {i: (self.params[i].data, self.params[i].grad) for i in everyone}
        for i in everyone:
            self.params[i].grad = None
            self.params[i].data = values[i]
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        finally:
            self._swap_out(kept)
        if self.option != "fp32":  # ... and back to S where the option stores it so (exact: S -> f32 -> S)
            for p in self.params:
                if p in self.optimizer.state:
                    _state_to(self.optimizer.state[p], self.dtype)
