"""Which precision runs where, and what the tensors look like in it.

Holds: the device (``device``), a batch moved to it (``batches``), precision resolution, autocast,
TF32 and fp32 islands (``plan``), float8 through torchao (``fp8``), ``precision.fp32_modules``
(``fp32_modules``), the per-tensor health numbers (``health``), the per-module probe
(``probe``) and the search for where non-finite values and misplaced tensors come from
(``diagnostics``).

May import: ``config`` (its section, ``PrecisionConfig``), ``torchimpl._torch_compat`` and
``torchimpl.safe_files`` (a diagnosis report file); nothing else of torchimpl. Imported by
``train``, ``doctor``, ``cli``.
"""
