"""Mutation check: deliberate mixed-precision bugs in a copy of torchimpl, each of which the
conformance suite must catch ("the suite has teeth").

Run from the repository root (a few minutes on 2 cores; not part of ``pytest``):

    PYTHONPATH=. python -m conformance.mutations            # every mutant
    PYTHONPATH=. python -m conformance.mutations tracker_not_reset loss_not_divided_by_k

For each mutant the script copies ``reference/``, ``torchimpl/`` and ``conformance/`` into a
temporary folder, applies one source edit to the copy of torchimpl (``SPEC_MUTANTS``: of the
specification's optimizers, each caught by its own conformance property) (the edit must match the
production source exactly, else the script stops: a mutant that no longer applies is reported,
never silently skipped), and runs ``pytest -x -q`` on the conformance files relevant to it, in
the exact mode (``ATEN_CPU_CAPABILITY=default``) with the ``ci`` profile. The unmutated copy
runs first and must pass. A mutant is killed when pytest exits non-zero. Exit status: 0 when
every mutant is killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = "torchimpl/train/step.py"
LOSS_SCALING = "torchimpl/train/loss_scaling.py"
SCALER = "torchimpl/train/scaler.py"
OPTIM = "torchimpl/train/optim.py"
SCHEDULE = "torchimpl/train/schedule.py"
TRAINER_TESTS = ("conformance/test_trainer.py",)
TRAINER = "torchimpl/train/trainer.py"
COMPILE_TESTS = ("conformance/test_compile_trainer.py",)
SCALER_TESTS = ("conformance/test_scaler.py", "conformance/test_trainer.py")
DISTRIBUTED = "torchimpl/distributed/context.py"
DISTRIBUTED_TESTS = ("conformance/test_distributed.py",)
MASTER = "torchimpl/train/master_weights.py"
MASTER_TESTS = ("conformance/test_master_weights.py",)
FUSED_16_TESTS = ("conformance/test_master_weights.py::test_fused_sgd_and_adagrad_on_16_bit_parameters_round_as_rule_15_says",)
GRAD_REDUCTION = "reference/grad_reduction.py"
ADAFACTOR_16_TESTS = ("conformance/test_master_weights.py::test_adafactor_on_16_bit_parameters_factors_matrices_and_3d_tensors",)


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


_UNSCALE = """        self.scaling.unscale_(self.optimizer, found)
        return self._clip(found)  # the clip's multiply checks the unscaled gradients
"""
_CLIP_FIRST = """        clipped = self._clip(found)
        self.scaling.unscale_(self.optimizer, found)
        return clipped
"""
_GRADS = "[p.grad for g in optimizer.param_groups for p in g['params'] if p.grad is not None]"

MUTANTS = (
    Mutant("clip_before_unscale", "clip the scaled gradients, then unscale", STEP, _UNSCALE, _CLIP_FIRST,
           TRAINER_TESTS),
    Mutant("schedule_on_skipped_step", "advance the LR schedule on a skipped step", STEP,
           "        self.schedule.step(applied)\n", "        self.schedule.step(True)\n", TRAINER_TESTS),
    Mutant("unscale_twice", "multiply by the inverse scale a second time", LOSS_SCALING,
           "        self.scaler.unscale_(optimizer, found)\n",
           "        self.scaler.unscale_(optimizer, found)\n"
           f"        torch._foreach_mul_({_GRADS},\n"
           "                            self.scaler.state_tensors()[0].double().reciprocal().float())\n",
           TRAINER_TESTS),
    Mutant("divide_by_scale", "unscale by dividing by the scale, not multiplying by its inverse", LOSS_SCALING,
           "        self.scaler.unscale_(optimizer, found)\n",
           f"        _grads = {_GRADS}\n"
           "        _scaled = [g.clone() for g in _grads]\n"
           "        self.scaler.unscale_(optimizer, found)\n"
           "        for _g, _s in zip(_grads, _scaled):\n"
           "            _g.copy_(_s / self.scaler.state_tensors()[0])\n",
           TRAINER_TESTS),
    Mutant("growth_without_finite_guard", "grow the scale even when the grown scale is inf", SCALER,
           "torch.where(grow & grow_ok, grown, scale)", "torch.where(grow, grown, scale)", SCALER_TESTS),
    Mutant("tracker_not_reset", "keep the growth tracker on an overflow", SCALER,
           "new_tracker = torch.where(found, torch.zeros_like(tracker), clean_tracker)",
           "new_tracker = torch.where(found, tracker, clean_tracker)", SCALER_TESTS),
    Mutant("loss_not_divided_by_k", "backward from the microbatch loss, not loss / k", STEP,
           "            scaled = loss / k\n", "            scaled = loss\n", TRAINER_TESTS),
    Mutant("scaler_not_restored", "ignore the scaler state of a checkpoint on resume", LOSS_SCALING,
           "        self.scaler.load_state_dict(state)\n", "        pass\n", TRAINER_TESTS),
    Mutant("ddp_reduces_every_microbatch", "DDP all-reduces every microbatch instead of the window's local sum",
           DISTRIBUTED, "            return self._ddp.no_sync()\n", "            return contextlib.nullcontext()\n",
           DISTRIBUTED_TESTS),
    Mutant("reduce_dtype_ignored_by_fsdp2", "FSDP2 reduces in fp32 whatever train.reduce_dtype says",
           "torchimpl/distributed/reduction.py",
           "        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=_DTYPES[self.reduce_dtype])\n",
           "        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=torch.float32)\n", DISTRIBUTED_TESTS),
    Mutant("param_dtype_ignored_by_fsdp2", "FSDP2 computes in fp32 though the parameters are held in bf16",
           "torchimpl/distributed/reduction.py",
           "        param = None if self.param_dtype is None else _DTYPES[self.param_dtype]\n",
           "        param = None\n", DISTRIBUTED_TESTS),
    Mutant("unscaled_overflow_applied", "check only the scaled gradients: apply the unscaled ones' inf/NaN", STEP,
           "        self.scaling.check_unscaled(found)\n", "", TRAINER_TESTS),
    Mutant("nonfinite_loss_applied", "apply a step whose loss is not finite (finite gradients)", STEP,
           "        if loss_bad and not is_found:  # a non-finite loss is skipped like non-finite gradients\n",
           "        if False:\n", TRAINER_TESTS),
    Mutant("bias_and_norm_decayed", "decay biases and norm weights despite no_decay_bias_and_norm", OPTIM,
           '{"params": no_decay, "weight_decay": 0.0}', '{"params": no_decay, "weight_decay": config.weight_decay}',
           TRAINER_TESTS),
    Mutant("user_scheduler_on_skipped_step", "step the user's LR scheduler on a skipped step too", SCHEDULE,
           "        if applied and self.scheduler is not None:\n", "        if self.scheduler is not None:\n",
           TRAINER_TESTS),
    Mutant("user_scheduler_not_restored", "ignore the user's scheduler state on resume", SCHEDULE,
           '            self.scheduler.load_state_dict(state["scheduler"])\n', "            pass\n", TRAINER_TESTS),
    # Master weights (torchimpl/train/master_weights.py), each caught by conformance/test_master_weights.py.
    Mutant("kahan_compensation_lost", "kahan drops what the rounding lost instead of keeping it", MASTER,
           "                c.copy_((y - (t.float() - start[i])).to(self.dtype))\n", "                c.zero_()\n",
           MASTER_TESTS),
    Mutant("fp32_master_not_written_back", "fp32: the stepped master is not cast back into the bf16/fp16 weight",
           MASTER, "            self.params[i].copy_(masters[i])\n", "            pass\n", MASTER_TESTS),
    Mutant("state_cast_to_storage_skipped", "kahan/stochastic keep the optimizer state in float32 (its cast skipped)",
           MASTER, "                _state_to(states[self.params[i]], self.dtype)\n", "                pass\n",
           MASTER_TESTS),
    Mutant("stochastic_rounds_away_on_equal_bits", "stochastic rounding rounds away when the bits equal the low half",
           MASTER, "torch.where(bits < (pattern & 0xFFFF)", "torch.where(bits <= (pattern & 0xFFFF)", MASTER_TESTS),
    # train.compile: the switch must compile the module the microbatches call, once per graph.
    Mutant("compile_ignored", "train.compile reports a compiled run but trains the eager module", TRAINER,
           "            forward_model = torch.compile(forward_model)\n", "            pass\n", COMPILE_TESTS),
    Mutant("compile_scaler_not_restored", "a compiled run ignores the scaler state of a checkpoint on resume",
           LOSS_SCALING, "        self.scaler.load_state_dict(state)\n", "        pass\n", COMPILE_TESTS),
)


def _optimizer_property(name: str, impl: str) -> tuple[str, ...]:
    return (f"conformance/test_optimizers.py::test_optimizer_steps_match_the_spec[cpu-{name}-{impl}]",)


FUSED_KERNEL_TESTS = ("conformance/test_fused_kernels.py",
                      "conformance/test_optimizers.py::test_native_float32_steps_are_bit_for_bit_on_avx2_kernels")
"""Rule 7 of `reference.optim._common`: its unit tests (any capability), then the native Adam(W)
property rerun under ``ATEN_CPU_CAPABILITY=avx2`` (the mutants' own run has the scalar kernels)."""
COMMON = "reference/optim/_common.py"


def _tensor_lr_property(name: str, impl: str, promoted: str = "") -> tuple[str, ...]:
    """The tensor-lr property of one path, and the float32 0-d test ``promoted`` names (if any)."""
    tests = (f"conformance/test_optimizers.py::test_tensor_lrs_and_zero_d_parameters_match_the_spec[cpu-{name}-{impl}]",)
    if promoted:
        promoting = "test_a_zero_d_parameter_meets_a_float64_tensor_lr_promoted"
        tests += (f"conformance/test_optimizers.py::{promoting}[cpu-{promoted}]",)
    return tests


# Spec mutants: one deliberate error in each optimizer's spec function, which that optimizer's
# conformance property must catch (it compares the spec with torch, so a wrong spec fails too).
SPEC_MUTANTS = (
    # The fused multiply-adds of torch's native float32 kernels (reference.optim._common rule 7).
    Mutant("fma32_rounds_twice", "the spec's float32 fma rounds the float64 sum to float32 without its fix-up",
           COMMON, "        if suspect is None or not suspect.any():\n",
           "        if True:\n", FUSED_KERNEL_TESTS),
    Mutant("addcmul_fused_rounds_the_product", "the spec's native addcmul rounds its product before the add",
           COMMON, "    return fma32(_F32(value) * np.asarray(a, _F32), b, x)\n",
           "    return x + (_F32(value) * np.asarray(a, _F32)) * b\n", FUSED_KERNEL_TESTS),
    Mutant("lerp_fused_rounds_the_product", "the spec's native lerp (|w| < 0.5) rounds w * (y - x) before the add",
           COMMON, "            return fma32(w, diff, x32)\n", "            return x32 + w * diff\n", FUSED_KERNEL_TESTS),
    # A row's position_free (reference.optim._registry): what lets the audit step a group joined.
    Mutant("adam_position_free_ignores_rule_4", "Adam's position_free says True at beta1 = 0 (rule 4's vectorized head)",
           "reference/optim/adam.py", "    return np.float32(1 - config.betas[0]) != 1\n", "    return True\n",
           ("conformance/test_joined_steps.py::test_a_joined_step_is_the_steps_one_by_one",)),
    Mutant("joined_zero_d_parameter", "step_joined lays a 0-d parameter into a run (rule 11's promotion lost)",
           "reference/optim/_registry.py", "    joins = [np.ndim(x) > 0 and np.size(x) < JOINED_SMALL for x in params]\n",
           "    joins = [np.size(x) < JOINED_SMALL for x in params]\n",
           ("conformance/test_joined_steps.py::test_a_zero_d_parameter_is_never_joined",)),
    Mutant("lowprec_add_rounds_once", "the spec's bf16 add with alpha skips the rounding of the product to S",
           "reference/lowprec.py", "    return _r(_f(x) + _f(_r(a * _f(y), x.dtype)), x.dtype)\n",
           "    return _r(_f(x) + a * _f(y), x.dtype)\n", MASTER_TESTS),
    Mutant("lowprec_scalar_in_storage_format", "the spec's bf16 multiply rounds its Python scalar to S",
           "reference/lowprec.py", "    return _r(_f(x) * _F32(s), x.dtype)\n",
           "    return _r(_f(x) * _f(np.asarray(_F32(s)).astype(x.dtype)), x.dtype)\n", MASTER_TESTS),
    Mutant("lowprec_radam_foreach_quotient_unrounded",
           "the spec's foreach RAdam takes the reciprocal of a quotient it never rounded to S",
           "reference/lowprec.py",
           "    buffer = add_scalar(div(np.ones_like(v), div_scalar(add_scalar(sqrt(v), c.eps), scale)), unrect)\n",
           "    buffer = add_scalar(_r(_F32(1) / (_f(add_scalar(sqrt(v), c.eps)) / _F32(scale)), v.dtype), unrect)\n",
           MASTER_TESTS),
    Mutant("lowprec_fused_sgd_store_rounded_twice",
           "the spec's fused SGD on S rounds the update to S before the subtraction (two roundings, not one)",
           "reference/lowprec.py", "    out[body:] = _r(_madd(-d, _F32(lr), pf, native), p.dtype)\n",
           "    out[body:] = _r(pf - _f(_r(d * _F32(lr), p.dtype)), p.dtype)\n", FUSED_16_TESTS),
    Mutant("lowprec_fused_sgd_vector_loop_steps",
           "the spec's fused SGD on S updates the weights of the vector loop, which torch's kernel never stores",
           "reference/lowprec.py", "    n, body = p.size, _body(p)\n", "    n, body = p.size, 0\n", FUSED_16_TESTS),
    Mutant("lowprec_fused_adagrad_sum_rounded_before_sqrt",
           "the spec's fused Adagrad on S takes the root of the sum rounded to S, not of its float32 value",
           "reference/lowprec.py", "(np.sqrt(total) + _fused_scalar(p, c.eps))",
           "(np.sqrt(_f(_r(total, p.dtype))) + _fused_scalar(p, c.eps))", FUSED_16_TESTS),
    Mutant("lowprec_adafactor_rsqrt_rounds_once",
           "the spec's Adafactor on S takes rsqrt with one rounding, not the scalar kernel's root rounded to S first",
           "reference/lowprec.py", "    return _r(_F32(1) / _f(sqrt(x)), x.dtype)\n",
           "    return _r(_F32(1) / np.sqrt(_f(x)), x.dtype)\n", ADAFACTOR_16_TESTS),
    Mutant("reductions_bf16_norm_in_order",
           "the spec's bfloat16 norm adds its squares in order, not in torch's 8 lanes over 16-element blocks",
           "reference/reductions.py", '        lanes_bf16 = storage.name == "bfloat16"\n',
           "        lanes_bf16 = False\n", ("conformance/test_reductions.py::test_16_bit_norms_follow_torchs_order",)),
    Mutant("lowprec_avx2_block_is_its_vector",
           "the spec's AVX2 kernels split head and tail at one 32-byte vector, not the loop's 64-byte pass",
           "reference/lowprec.py", '"AVX2": 64,', '"AVX2": 32,',
           ("conformance/test_master_weights.py::test_none_steps_match_the_spec_on_avx2_kernels",)),
    Mutant("kahan_spec_forgets_old_compensation", "the spec's kahan takes the new compensation from u alone",
           "reference/master_weights.py", "        c = (y - (_f32(t) - p32)).astype(storage)\n",
           "        c = (u - (_f32(t) - p32)).astype(storage)\n", MASTER_TESTS),
    Mutant("sgd_dampening_on_first_step", "SGD dampens the first momentum buffer", "reference/optim/sgd.py",
           "                buf = np.array(d, copy=True)\n",
           "                buf = f(1 - config.dampening) * d\n", _optimizer_property("SGD", "for-loop")),
    Mutant("adam_bias_correction2_skipped", "Adam forgets the second bias correction", "reference/optim/adam.py",
           "    denom = np.add(np.divide(root, f(bias_correction2_sqrt), out=new_p), f(config.eps), out=new_p)\n",
           "    denom = np.add(root, f(config.eps), out=new_p)\n",
           _optimizer_property("Adam", "foreach")),
    Mutant("adagrad_lr_decay_from_step_one", "Adagrad decays the rate by step instead of step - 1",
           "reference/optim/adagrad.py", "        denominator = 1 + (float(step) - 1) * config.lr_decay\n",
           "        denominator = 1 + float(step) * config.lr_decay\n", _optimizer_property("Adagrad", "for-loop")),
    Mutant("rmsprop_centered_adds_the_mean_square", "centered RMSprop adds grad_avg**2 instead of subtracting it",
           "reference/optim/rmsprop.py", "            avg = root(addcmul(square_avg, grad_avg, grad_avg, -1))\n",
           "            avg = root(addcmul(square_avg, grad_avg, grad_avg, 1))\n", _optimizer_property("RMSprop", "foreach")),
    Mutant("adamax_eps_outside_the_max", "Adamax adds eps after the max instead of to |d| inside it",
           "reference/optim/adamax.py", "        exp_inf = np.maximum(s.exp_inf * f(beta2), np.abs(d) + f(c.eps))\n",
           "        exp_inf = np.maximum(s.exp_inf * f(beta2), np.abs(d)) + f(c.eps)\n",
           _optimizer_property("Adamax", "for-loop")),
    Mutant("adadelta_root_of_the_old_square_avg", "Adadelta's step takes the root of the old square average",
           "reference/optim/adadelta.py", "        std = root(square_avg + f(c.eps))\n",
           "        std = root(s.square_avg + f(c.eps))\n", _optimizer_property("Adadelta", "foreach")),
    Mutant("nadam_mu_product_in_float64", "NAdam multiplies its mu_product in float64 and rounds once",
           "reference/optim/nadam.py", "        mu_product = np.float32(s.mu_product * np.float32(mu))\n",
           "        mu_product = np.float32(float(s.mu_product) * mu)\n", _optimizer_property("NAdam", "for-loop")),
    Mutant("radam_true_division", "RAdam's for-loop divides sqrt(bc2) by the root (torch takes a reciprocal)",
           "reference/optim/radam.py", "                adaptive = (f(1) / (root(exp_avg_sq) + f(c.eps))) * f(bc2**0.5)\n",
           "                adaptive = f(bc2**0.5) / (root(exp_avg_sq) + f(c.eps))\n",
           _optimizer_property("RAdam", "for-loop")),
    Mutant("adafactor_beta2_decay_halved", "Adafactor weighs the new square by t ** (beta2_decay / 2)",
           "reference/optim/adafactor.py", "        w = t ** c.beta2_decay\n        rho",
           "        w = t ** (c.beta2_decay * 0.5)\n        rho", _optimizer_property("Adafactor", "for-loop")),
    Mutant("adafactor_row_mean_over_the_columns", "Adafactor divides the row norms' squares by the column length",
           "reference/optim/adafactor.py", "(n_r * n_r) / f(d.shape[-1])", "(n_r * n_r) / f(d.shape[-2])",
           _optimizer_property("Adafactor", "foreach")),
    Mutant("reductions_tail_after_the_lanes", "torch.sum's emulation adds the lanes before the tail elements",
           "reference/reductions.py",
           "        acc = _seq(np.zeros(b, x.dtype), x[:, count * width:], -1)\n        acc = _seq(acc, vec, -1)\n",
           "        acc = _seq(np.zeros(b, x.dtype), vec, -1)\n        acc = _seq(acc, x[:, count * width:], -1)\n",
           ("conformance/test_reductions.py",)),
    # Tensor learning rates (reference.optim._lr and each optimizer's own rule).
    Mutant("adagrad_tensor_lr_read_as_a_float", "the for-loop Adagrad divides a tensor lr in float64",
           "reference/optim/adagrad.py", "            return addcdiv(p, d, std, _lr.value(minus_clr)), new_state, g\n",
           "            return addcdiv(p, d, std, -(lr / denominator)), new_state, g\n",
           _tensor_lr_property("Adagrad", "for-loop")),
    Mutant("adagrad_foreach_numerator_in_place", "Adagrad's foreach multiplies the gradients in place always",
           "reference/optim/adagrad.py", "        numerator = _lr.binary(\"*\", d, minus_clr, inplace=owned)\n",
           "        numerator = _lr.binary(\"*\", d, minus_clr, inplace=True)\n",
           _tensor_lr_property("Adagrad", "foreach", "Adagrad-foreach")),
    Mutant("rmsprop_tensor_lr_in_float32", "RMSprop reads a tensor lr rounded to float32",
           "reference/optim/rmsprop.py", "    rate, root = lr_value(config, lr), np.sqrt if sqrt is None else sqrt\n",
           "    rate, root = lr_value(config, lr if lr is None else np.float32(lr)), np.sqrt if sqrt is None else sqrt\n",
           _tensor_lr_property("RMSprop", "for-loop")),
    Mutant("adadelta_tensor_lr_in_float32", "Adadelta reads a tensor lr rounded to float32",
           "reference/optim/adadelta.py",
           "    rate, root, c = lr_value(config, lr), np.sqrt if sqrt is None else sqrt, config\n",
           "    rate, root, c = lr_value(config, lr if lr is None else np.float32(lr)), np.sqrt if sqrt is None else sqrt, "
           "config\n", _tensor_lr_property("Adadelta", "foreach")),
    Mutant("adamax_tensor_lr_read_as_a_float", "the for-loop Adamax divides a tensor lr in float64",
           "reference/optim/adamax.py",
           "        clr = rate / bc if tensor is None else _lr.value(_lr.over(tensor, bc))\n",
           "        clr = rate / bc\n", _tensor_lr_property("Adamax", "for-loop")),
    Mutant("nadam_tensor_lr_sizes_read_as_floats", "the for-loop NAdam computes its step sizes from lr.item()",
           "reference/optim/nadam.py", "        if tensor is None or foreach:\n", "        if True:\n",
           _tensor_lr_property("NAdam", "for-loop")),
    Mutant("radam_tensor_lr_product_not_promoted", "the for-loop RAdam multiplies m_hat by a tensor lr in f",
           "reference/optim/radam.py", "_lr.binary(\"*\", m_hat, tensor, inplace=False)",
           "_lr.binary(\"*\", m_hat, tensor, inplace=True)",
           _tensor_lr_property("RAdam", "for-loop", "RAdam-for-loop")),
    Mutant("tensor_lr_zero_d_not_promoted", "two 0-d tensors compute in the first one's dtype",
           "reference/optim/_lr.py", "    return x.dtype if x.ndim > 0 else np.promote_types(x.dtype, t.dtype)\n",
           "    return x.dtype\n", _tensor_lr_property("NAdam", "foreach", "NAdam-foreach-decoupled_weight_decay-weight_decay")),
    # Gradient reductions across ranks (reference.grad_reduction), each against 2-rank gloo.
    Mutant("grad_reduction_avg_divides_before_the_sum", "FSDP2's AVG divides each rank before the sum",
           GRAD_REDUCTION, '        return Reduction(reduce_dtype, world_size, post=float(world_size), op="avg")\n',
           '        return Reduction(reduce_dtype, world_size, pre=("div", float(world_size)), op="avg")\n',
           DISTRIBUTED_TESTS),
    Mutant("grad_reduction_sum_not_rounded", "the wire sum stays in float32 (the wire dtype's rounding skipped)",
           GRAD_REDUCTION, "        return (a.astype(np.float32) + b.astype(np.float32)).astype(WIRE_DTYPES[wire])\n",
           "        return a.astype(np.float32) + b.astype(np.float32)\n", DISTRIBUTED_TESTS),
    Mutant("grad_reduction_wire_cast_skipped", "the float32 gradient is divided before its cast to bf16/fp16",
           GRAD_REDUCTION, "    pre = [_pre(to_wire(v, red.wire), red) for v in vals]\n"
           "    return _post(gloo_sum(pre, red.wire), red).astype(np.float32)\n",
           "    pre = [_pre(np.asarray(v, np.float32), red) for v in vals]\n"
           "    return _post(gloo_sum(pre, red.wire), red).astype(np.float32)\n", DISTRIBUTED_TESTS),
    Mutant("grad_reduction_fp16_split_ignored", "FSDP2 divides fp16 after the sum only, as for bf16",
           GRAD_REDUCTION, '    if reduce_dtype != "fp16":\n', '    if True:\n', DISTRIBUTED_TESTS),
)


# What a mutant's copy of the project holds, and the environment its tests run in: the
# conformance suite's, in exact mode under the CI profile. Other catalogues (the audit's) pass theirs.
COPIED = ("reference", "torchimpl", "conformance")
TEST_ENV = {"ATEN_CPU_CAPABILITY": "default", "AMPSPEC_HYPOTHESIS_PROFILE": "ci"}


def _copy_tree(dest: Path, copied: tuple[str, ...] = COPIED) -> None:
    for name in copied:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
        else:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def _run_tests(root: Path, tests: tuple[str, ...], env: dict[str, str] = TEST_ENV) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=root, env=env, capture_output=True, text=True)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run(names: list[str], mutants: tuple[Mutant, ...] = MUTANTS, copied: tuple[str, ...] = COPIED,
        env: dict[str, str] = TEST_ENV) -> int:
    """Run the ``mutants`` named (all when ``names`` is empty), each in a copy of the project's
    ``copied`` folders and files, its tests under ``env``; 0 when every one is killed."""
    chosen = [m for m in mutants if not names or m.name in names]
    unknown = sorted(set(names) - {m.name for m in mutants})
    if unknown:
        print(f"unknown mutants {unknown}; known: {[m.name for m in mutants]}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ampspec-mutants-") as tmp:
        base = Path(tmp) / "baseline"
        _copy_tree(base, copied)
        tests = tuple(sorted({t for m in chosen for t in m.tests}))
        proc = _run_tests(base, tests, env)
        if proc.returncode != 0:
            print(f"baseline (no mutation) FAILS, so kills would mean nothing:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}")
            return 1
        print(f"baseline passes: {_last_line(proc.stdout)}  ({time.perf_counter() - t0:.0f} s)")
        killed = 0
        for m in chosen:
            t1 = time.perf_counter()
            work = Path(tmp) / m.name
            _copy_tree(work, copied)
            path = work / m.file
            source = path.read_text()
            if source.count(m.old) != 1:
                print(f"{m.name}: the edit no longer applies to {m.file} ({source.count(m.old)} matches): update it")
                return 1
            path.write_text(source.replace(m.old, m.new))
            proc = _run_tests(work, m.tests, env)
            dead = proc.returncode != 0
            killed += dead
            first = next((ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))), "")
            print(f"{m.name:28s} {'killed' if dead else 'SURVIVED'}  ({time.perf_counter() - t1:.0f} s)  "
                  f"{m.bug}\n    {first or _last_line(proc.stdout)}")
            shutil.rmtree(work)
    print(f"{killed} of {len(chosen)} mutants killed in {time.perf_counter() - t0:.0f} s")
    return 0 if killed == len(chosen) else 1


def cli(prog: str, doc: str, mutants: tuple[Mutant, ...], argv: list[str] | None = None) -> int:
    """The command line of a mutation module: the mutants named, or all."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("mutants", nargs="*", help="names of the mutants to run (default: all)")
    return run(parser.parse_args(argv).mutants, mutants)


def main(argv: list[str] | None = None) -> int:
    return cli("python -m conformance.mutations", __doc__, MUTANTS + SPEC_MUTANTS, argv)


if __name__ == "__main__":
    sys.exit(main())
