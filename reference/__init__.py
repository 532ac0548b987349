"""ampspec's executable specification of mixed-precision training.

Pure NumPy and ml_dtypes: this package never imports torch. Each module holds one mechanism
and states its rules as a numbered list in its docstring; each public function states its rule,
the dtypes it takes and its edge cases.

- `reference.formats`: number formats, casts, tf32 rounding, ULP distances.
- `reference.scaling`: dynamic loss scaling (torch's rules, and the Megatron/DeepSpeed presets).
- `reference.clipping`: gradient clipping by norm and by value, with torch's summation order.
- `reference.optim`: torch.optim's optimizers as torch computes them (for-loop, foreach, fused), one module each, and their registry.
- `reference.step`: the training-step contract (parameter groups, fused and sync-free optimizer
  calls), its record, and the replay of a recorded trace.
- `reference.precision`: which precision a device and a request resolve to.
- `reference.autocast`: which dtype autocast gives each operation, per device type.
- `reference.master_weights`: parameters stored in bfloat16/float16 and the master-weight options
  (`none`, `fp32`, `kahan`, `stochastic` with explicit random bits), their bytes per parameter;
  `reference.lowprec`: torch's optimizer kernels on such parameters (the `none` option).
- `reference.fp8`: scaled float8 training: amax, scales, saturating casts and scaled matmuls of
  torchao's tensorwise, rowwise and rowwise_with_gw_hp recipes, MX block scaling, and Transformer
  Engine's delayed and current scaling and DeepSeek-V3's block quantization as state machines.

``python -m reference`` prints the rules of a dynamic loss-scale schedule with a worked example;
``python -m reference --fp8`` those of scaled float8 training.
"""
