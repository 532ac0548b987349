"""Sick models for ``ampspec doctor`` (and healthy ones), each a task of the ``module:make``
protocol returning ``(model, train_data, val_data)``; ``CATALOGUE`` states what the doctor must
say about each: the precision, the doctor's options, and the exact verdicts (kind, module)."""
