"""The training loop: the trainer, the step engine and what one optimizer step is made of.

Holds: the trainer and its per-fit state (``trainer``), the hooks (``callbacks``, checked by
``callback_checks``), the step engine (``step``), the loss protocol (``loss_protocol``), the loss
scaler's torch mechanics (``scaler``; its policy is ``config.scale_policy``), clipping (``clipping``),
optimizers (``optim``), schedules (``schedule``), the periodic work (``cadence``), the log point
(``reporting``), per-layer statistics while training (``precision_stats``), CPU threads
(``threads``).

May import: ``config``, ``precision``, ``run``, ``torchimpl.distributed``,
``torchimpl.safe_files``, ``torchimpl._torch_compat``. Never ``doctor``, ``cli``, ``task`` or ``reference``.
"""
