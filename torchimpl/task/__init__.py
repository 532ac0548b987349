"""A user's task (``task.name``) and the embedded ones: what a task must be, and the tasks built in.

Holds: the checks on a user's task (``checks``), its failure while training (``failure``), the
embedded tasks (``builtin``).

May import: ``config``; ``failure`` imports nothing (the command line's error handler uses it
without importing torch).
"""
