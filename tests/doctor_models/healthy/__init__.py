"""Healthy models of the architectures people train, at realistic proportions scaled down to run
on a CPU in seconds, with the usual random initialisation: the doctor must give none of them an
error or a warning, in bf16 or in fp16. Each is a task (``(model, train_batches, None)``, the model
returning its loss from ``model(inputs, targets)``); ``HEALTHY`` lists them, ``CI`` the ones every
test run diagnoses (the rest run with ``--runslow``)."""

from doctor_models.healthy.models import CI, HEALTHY

__all__ = ["CI", "HEALTHY"]
