"""``inspect_precision``, the doctor: a few steps of a model, measured, judged and reported.

Holds: the inspection (``inspect``), its per-layer numbers (``stats``, computed a step at a time
by ``batch``), the shadow's optimizer kept in step (``shadow``), verdicts (``verdicts``) and
report (``report``).

May import: ``precision`` (health, probe, diagnostics), ``run.checkpoint`` (the RNG state),
``train.loss_protocol`` and, inside one function, ``torchimpl.spec_bridge`` (the CPU autocast
note that reads the specification's op table). Never ``cli``.
"""
