"""One training configuration: its schema, its loading from YAML and ``--set``, its errors.

Holds: the exceptions (``problems``), the sections and the whole (``schema``), loading and
overrides (``loading``), safe YAML (``safe_yaml``), the embedded tasks' names and defaults
(``embedded``).

May import: ``precision.plan``, ``train.optim`` and ``train.scaler`` for the sections defined
beside the code they configure (``PrecisionConfig``, ``OptimizerConfig``, ``ScalerConfig``);
``problems``, ``safe_yaml`` and ``embedded`` import nothing of torchimpl and no torch.
"""
