"""ampspec's executable specification of mixed-precision training.

Pure NumPy and ml_dtypes: this package never imports torch. Each module holds one mechanism
and states its rules as a numbered list in its docstring; each public function states its rule,
the dtypes it takes and its edge cases.
"""
