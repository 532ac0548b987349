"""One training configuration: its schema, its loading from YAML and ``--set``, its errors.

Holds: the exceptions (``problems``), the sections and the whole (``schema``), the precision and
optimizer sections (``sections``: ``PrecisionConfig``, ``OptimizerConfig``), the loss scale's
policy (``scale_policy``: ``ScalerConfig``), loading and overrides (``loading``), safe YAML
(``safe_yaml``), the embedded tasks' names and defaults (``embedded``).

May import: nothing of torchimpl outside itself (the bottom room: every other room imports it),
and no torch.
"""
