"""Loading a configuration: plain data (YAML, dicts, flat keywords, ``key=value`` overrides)
checked and built into the typed sections of ``torchimpl.config.schema``.

Generic in the configuration class (passed as ``cls``), so that the schema calls it from its own
methods (``Config.from_dict``, ``Config.from_kwargs``) without an import cycle. Every problem is
collected, then raised as one :class:`~torchimpl.config.problems.ConfigError` naming each bad
field by its dotted path.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Literal, Mapping, Sequence

from torchimpl.config import safe_yaml
from torchimpl.config.problems import ConfigError
from torchimpl.config.sections import PrecisionConfig

__all__ = ["KEYWORDS", "config_from_kwargs", "overrides_applied", "section_types"]


@functools.cache
def section_types(cls: type) -> dict[str, type]:
    """The sections of the configuration class ``cls``: its fields whose types are dataclasses."""
    return {name: tp for name, tp in typing.get_type_hints(cls).items() if dataclasses.is_dataclass(tp)}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------- generic typed building


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_describe(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_NO = object()


def _coerce(tp: Any, value: Any) -> Any:
    """``value`` converted to type ``tp``, or ``_NO`` when it does not fit."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        return None if value is None else _NO
    if origin is Literal:
        return value if any(value == a and type(value) is type(a) for a in typing.get_args(tp)) else _NO
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            out = _coerce(arg, value)
            if out is not _NO:
                return out
        return _NO
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return _NO
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(args[0], v) for v in value]
        elif len(args) == len(value):
            items = [_coerce(a, v) for a, v in zip(args, value)]
        else:
            return _NO
        return _NO if any(i is _NO for i in items) else tuple(items)
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads ``3e-4`` without a dot as a string; accept it as a number.
            try:
                return float(value)
            except ValueError:
                return _NO
        return _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if isinstance(tp, type):
        return value if isinstance(value, tp) else _NO
    return value


def _section_as_written(path: str, value: Any) -> Any:
    """The one place a section may be written as one value: ``precision: bf16-mixed`` (a file,
    ``Config(precision=...)``, ``--set precision=...``, ``Trainer(precision=...)``) is
    ``precision: {mode: bf16-mixed}``; :class:`PrecisionConfig` reads the spelling (its rule 8).
    Anything else comes back as it is."""
    if path == "precision" and not isinstance(value, (Mapping, PrecisionConfig)):
        return {"mode": value}
    return value


def _wrong_type(tp: Any, value: Any) -> str:
    hint = ""
    if value is False and _coerce(tp, "no") is not _NO:
        hint = " (YAML reads an unquoted no as false: write 'no' in quotes)"
    return f"must be {_describe(tp)}, got {value!r}{hint}"


def _build(cls: type, data: Any, prefix: str, errors: list[tuple[str, str]]) -> Any:
    where = "configuration"
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        errors.append((prefix, f"must be a mapping of keys to values, got {data!r}") if prefix else
                      ("", f"{where} must be a mapping of keys to values, got {data!r}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(
                (_join(prefix, str(key)), f"unknown key{hint}; allowed: {', '.join(fields)}")
            )
    kwargs: dict[str, Any] = {}
    start = len(errors)
    for name in fields:
        if name not in data:
            continue
        tp, value, path = hints[name], data[name], _join(prefix, name)
        if dataclasses.is_dataclass(tp):
            sub = _build(tp, _section_as_written(path, value), path, errors)
            if sub is not None:
                kwargs[name] = sub
            continue
        out = _coerce(tp, value)
        if out is _NO:
            errors.append((path, _wrong_type(tp, value)))
        else:
            kwargs[name] = out
    # Construct with the well-typed values even after an error, so that range errors in
    # the other fields are reported in the same go.
    result = _construct(cls, kwargs, prefix, errors)
    if len(errors) > start or any(k not in fields for k in data):
        return None
    return result


def _construct(cls: type, kwargs: dict[str, Any], prefix: str, errors: list[tuple[str, str]]) -> Any:
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        errors.extend((_join(prefix, p), m) for p, m in exc.errors)
        return None
    except (ValueError, TypeError) as exc:
        first = str(exc)  # the name bound by ``as`` is cleared when the handler ends
    # A section validated by its own class raises on its first bad field: try each field
    # alone against the defaults so that every bad one is named.
    found = False
    for name, value in kwargs.items():
        if dataclasses.is_dataclass(value):
            continue
        try:
            cls(**{name: value})
        except (ValueError, TypeError) as exc:
            found = True
            errors.append((_join(prefix, name), _strip_name(str(exc), name)))
    if not found:
        errors.append((prefix, first))
    return None


def _strip_name(message: str, name: str) -> str:
    # "invalid ScalerConfig: growth_factor must be > 1, got 0.5" reads "scaler.growth_factor:
    # must be > 1, got 0.5": the path already names the section and the field.
    message = message.removeprefix("invalid ScalerConfig: ")
    return message[len(name):].lstrip(" :") if message.startswith(name + " ") else message


# ---------------------------------------------------------------- files and overrides


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b]... = value`` for ``dotted`` ``"a.b..."``; a section on the way that holds
    a value other than a mapping is an error (never silently replaced)."""
    parts = dotted.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif dataclasses.is_dataclass(child) and not isinstance(child, type):
            child = node[part] = _plain(dataclasses.asdict(child))
        elif not isinstance(child, dict):
            section = ".".join(parts[:depth + 1])
            raise ConfigError([(section, f"must be a mapping of keys to values, got {child!r} "
                                         f"(write {section}: {{{parts[depth + 1]}: ...}})")])
        node = child
    node[parts[-1]] = value


def _parse_overrides(overrides: Sequence[str], bad: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    """``"dotted.key=value"`` strings as ``(key, value)`` pairs, values parsed as YAML."""
    pairs = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not p for p in key.split(".")):
            bad.append((item, "an override must look like section.key=value, e.g. train.steps=100"))
            continue
        try:
            pairs.append((key, safe_yaml.load(raw, f"the value of {key}") if raw.strip() else ""))
        except safe_yaml.YamlError as exc:
            bad.append((key, f"value {raw!r} is refused: {exc}"))
    return pairs


def _dotted_pairs(key: str, value: Any) -> list[tuple[str, Any]]:
    """A section written as one value sets its fields one by one, so that ``precision=16-mixed``
    keeps the section's other fields; any other value sets ``key`` itself."""
    written = _section_as_written(key, value)
    if written is value:
        return [(key, value)]
    return [(_join(key, name), v) for name, v in written.items()]


def _apply_dotted(cls: type, tree: dict[str, Any], pairs: Sequence[tuple[str, Any]],
                  bad: list[tuple[str, str]]) -> None:
    """Set each ``(dotted key, value)`` in ``tree`` (sections of ``cls``); problems are added to ``bad``."""
    for name in section_types(cls):
        # So that a dotted key can go inside it: ``precision: bf16-mixed``, ``precision.dtype=fp16``.
        if name in tree:
            tree[name] = _section_as_written(name, tree[name])
    for key, value in pairs:
        try:
            for dotted, v in _dotted_pairs(key, value):
                _set_dotted(tree, dotted, v)
        except ConfigError as exc:  # a section that is not a mapping: named once, not once per key set in it
            bad.extend(e for e in exc.errors if e[0] not in {path for path, _ in bad})


def overrides_applied(cls: type, data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` (a configuration of class ``cls`` as plain data) with each
    ``"dotted.key=value"`` applied (value parsed as YAML); ``precision=bf16-mixed`` sets
    ``precision.mode``."""
    tree = _plain(dict(data))
    bad: list[tuple[str, str]] = []
    _apply_dotted(cls, tree, _parse_overrides(overrides, bad), bad)
    if bad:
        raise ConfigError(bad)
    return tree


# ---------------------------------------------------------------- keyword construction

KEYWORDS: dict[str, str] = {
    "precision": "precision",
    "max_steps": "train.steps",
    "steps": "train.steps",
    "accumulate": "train.microbatches",
    "accumulate_grad_batches": "train.microbatches",
    "clip": "train.clip_norm",
    "gradient_clip_val": "train.clip_norm",
    "lr": "optimizer.lr",
    "optimizer": "optimizer.name",
    "schedule": "schedule.name",
    "warmup_steps": "schedule.warmup_steps",
    "seed": "train.seed",
    "device": "device",
    "log_interval": "train.log_interval",
    "eval_interval": "train.eval_interval",
    "checkpoint_dir": "checkpoint.folder",
    "checkpoint_interval": "checkpoint.interval",
    "trace_file": "train.trace_file",
}
"""The flat keywords of :meth:`Config.from_kwargs` (and ``Trainer(**kw)``) and the field each
sets; ``max_steps``, ``accumulate_grad_batches`` and ``gradient_clip_val`` are Lightning's names."""

# Keywords that take a name only: an object belongs to Trainer.fit.
_NAME_ONLY = {
    "optimizer": ("an optimizer name ('adamw', 'adam', 'sgd')",
                  "a built torch.optim.Optimizer goes to Trainer.fit(..., optimizer=...)"),
    "schedule": ("a schedule name ('cosine', 'constant')",
                 "a torch learning-rate scheduler goes to Trainer.fit(..., scheduler=...)"),
}


def _not_a_config(value: Any) -> str:
    if hasattr(value, "forward") and hasattr(value, "parameters"):  # a model passed first by mistake
        return (f"got a model ({type(value).__name__}): the model goes to fit(model, train_data, val_data); "
                "the first argument is a torchimpl.Config, or leave it out and pass keywords")
    return (f"must be a torchimpl.Config, got {type(value).__name__}; build one with "
            "torchimpl.load_config('run.yaml') or Config.from_dict({...}), or pass keywords instead: "
            "Trainer(precision='bf16-mixed', max_steps=200)")


def _unknown_keyword(cls: type, key: str) -> str:
    fields = [path for path in _flatten_paths(cls().to_dict()) if path.rsplit(".", 1)[-1] == key]
    if fields:
        return (f"not a keyword; set {' or '.join(fields)} with overrides={{{fields[0]!r}: ...}}")
    close = difflib.get_close_matches(key, [*KEYWORDS, "overrides"], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"unknown keyword{hint}; keywords: {', '.join(KEYWORDS)}, and overrides (dotted keys, "
            "e.g. overrides={'scaler.growth_interval': 100})")


def _flatten_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        path = _join(prefix, key)
        out += _flatten_paths(value, path) if isinstance(value, Mapping) else [path]
    return out


def _keyword_pairs(cls: type, kwargs: Mapping[str, Any], bad: list[tuple[str, str]]) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, keyword)`` for each flat keyword; unknown ones are added to ``bad``."""
    out = []
    for key, value in kwargs.items():
        if key not in KEYWORDS:
            bad.append((key, _unknown_keyword(cls, key)))
        elif key in _NAME_ONLY and not isinstance(value, str):
            what, fix = _NAME_ONLY[key]
            bad.append((key, f"takes {what}, got {type(value).__name__}; {fix}"))
        elif key == "precision" and isinstance(value, Mapping):
            out += [(f"precision.{k}", v, key) for k, v in value.items()]
        else:
            out += [(dotted, v, key) for dotted, v in _dotted_pairs(KEYWORDS[key], value)]
    return out


def _override_pairs(overrides: Any, bad: list[tuple[str, str]]) -> list[tuple[str, Any, str]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        pairs = []
        for key, value in overrides.items():
            if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
                bad.append(("overrides", f"keys must be dotted field names like 'train.steps', got {key!r}"))
            else:
                pairs.append((key, value))
    elif isinstance(overrides, Sequence) and not isinstance(overrides, str) and all(
            isinstance(o, str) for o in overrides):
        pairs = _parse_overrides(overrides, bad)
    else:
        bad.append(("overrides", "must be a mapping of dotted keys to values, e.g. {'scaler.growth_interval': "
                                 f"100}}, or a list of 'key=value' strings; got {overrides!r}"))
        return []
    return [(key, value, "overrides") for key, value in pairs]


def config_from_kwargs(cls: Any, base: Any, kwargs: dict[str, Any]) -> Any:
    """:meth:`Config.from_kwargs` for the configuration class ``cls``."""
    if base is not None and not isinstance(base, cls):
        raise ConfigError([("config", _not_a_config(base))])
    if not kwargs:
        return base if base is not None else cls()
    bad: list[tuple[str, str]] = []
    overrides = kwargs.pop("overrides", None)
    pairs = _keyword_pairs(cls, kwargs, bad) + _override_pairs(overrides, bad)
    by_key: dict[str, str] = {}
    unique = []
    for key, value, source in pairs:
        if key in by_key:
            bad.append((source, f"sets {key}, which {by_key[key]} also sets; give it once"))
            continue
        by_key[key] = source
        unique.append((key, value))
    # The base's own section objects: a section no key goes into is kept as it is (a dotted key
    # opens its section into a mapping, see _set_dotted).
    tree = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)} if base is not None else {}
    _apply_dotted(cls, tree, unique, bad)
    try:
        result = cls.from_dict(tree)
    except ConfigError as exc:
        # Name a bad value by the keyword it was given as: "max_steps (train.steps): ...".
        named = {key: source for key, source in by_key.items() if source != "overrides"}
        bad += [(f"{named[p]} ({p})" if p in named and named[p] != p else p, m) for p, m in exc.errors]
        raise ConfigError(bad) from None
    if bad:
        raise ConfigError(bad)
    return result
