"""ampspec's production PyTorch package. It never imports ``reference``."""

__all__: list[str] = []
