"""A run's files and life: what is on disk, and how a run starts and ends.

Holds: checkpoint files (``checkpoint``), the run's state and what a checkpoint holds
(``state``), the trace (``records``), the metrics files (``metrics``), the run folder and its
lock (``folder``, ``lock``), the checks before step 1 and how a run ends (``lifecycle``).
Writing a run's own files safely is ``torchimpl.safe_files``, beside this package, since every
part writes through it.

May import: ``torchimpl.safe_files``; ``config`` (the saved configuration compared on resume);
``task.checks`` (``lifecycle``'s check of ``fit``'s data, at call time). Never ``train``,
``doctor``, ``cli`` or ``reference``.
"""
