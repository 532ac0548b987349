"""YAML for configuration files and ``--set`` values: safe, bounded, unambiguous.

1. Only YAML's plain types (``yaml.SafeLoader``): no ``!!python`` tags.
2. Aliases are bounded: the document, with every alias expanded, may hold at most
   :data:`MAX_VALUES` values, so a few lines of nested aliases ("billion laughs") are refused
   before anything is built; an alias inside its own anchor (``a: &a [*a]``) is refused too.
3. Nesting deeper than :data:`MAX_DEPTH` is refused.
4. A key given twice in one mapping (two ``train:`` sections) is refused, naming both lines:
   YAML would keep the last one silently.
5. Files are read as UTF-8 (a byte-order mark allowed); other bytes are refused naming the
   file and the offset. Each problem is a :class:`YamlError` naming the source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["MAX_DEPTH", "MAX_VALUES", "YamlError", "load", "read_file"]

MAX_VALUES = 10_000
"""Rule 2: values in a document with its aliases expanded (a configuration holds about 100)."""
MAX_DEPTH = 64
"""Rule 3: nesting of mappings and lists."""
MAX_BYTES = 1 << 20
"""A configuration file larger than this (1 MiB) is refused unread."""


class YamlError(ValueError):
    """A YAML source refused by one of the rules, naming the source."""


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


class _Bounds:
    """Rules 2-4 over the composed node graph, before any Python object is built."""

    def __init__(self, source: str):
        self.source = source
        self.sizes: dict[int, int] = {}
        self.open: set[int] = set()

    def size(self, node: yaml.Node, depth: int = 0) -> int:
        key = id(node)
        if key in self.sizes:
            return self.sizes[key]
        if key in self.open:
            raise YamlError(f"{self.source}: line {_line(node)}: an alias refers to the anchor it is inside "
                            "(a self-referencing structure); write the values out")
        if depth > MAX_DEPTH:
            raise YamlError(f"{self.source}: line {_line(node)}: nested deeper than {MAX_DEPTH} levels")
        self.open.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            self._unique_keys(node)
            for k, v in node.value:
                total += self.size(k, depth + 1) + self.size(v, depth + 1)
                if total > MAX_VALUES:
                    break
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += self.size(item, depth + 1)
                if total > MAX_VALUES:
                    break
        self.open.discard(key)
        if total > MAX_VALUES:
            raise YamlError(f"{self.source}: line {_line(node)}: its aliases expand to more than {MAX_VALUES} "
                            "values (an alias bomb?); a configuration needs no such structure")
        self.sizes[key] = total
        return total

    def _unique_keys(self, node: yaml.MappingNode) -> None:
        seen: dict[str, int] = {}
        for k, _ in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if k.value in seen:
                    raise YamlError(f"{self.source}: line {_line(k)}: key {k.value!r} is given twice (first on line "
                                    f"{seen[k.value]}); YAML would keep only the last one: merge them into one")
                seen[k.value] = _line(k)


def load(text: str, source: str) -> Any:
    """Rules 1-4: the document in ``text`` (``source`` names it in errors)."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise YamlError(f"{source}: nested too deeply to read") from None
        except yaml.YAMLError as exc:
            raise YamlError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from None
        if node is None:
            return None
        _Bounds(source).size(node)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as exc:
            raise YamlError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        loader.dispose()


def read_file(path: str | Path) -> str:
    """Rule 5: the text of ``path``; ``OSError`` when it cannot be read, ``YamlError`` when it is not UTF-8."""
    path = Path(path)
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise YamlError(f"{path} is larger than {MAX_BYTES >> 20} MiB: not a configuration file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise YamlError(f"{path} is not UTF-8 text (byte {exc.start} is {data[exc.start:exc.start + 1]!r}); "
                        "save it as UTF-8") from None
