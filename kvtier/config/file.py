"""Reading a YAML config file strictly, before any key is looked at: UTF-8 text, no key given
twice in one mapping, a mapping at the top level. Every problem is a `ConfigError` naming the
file; a YAML syntax error says what and where without the quoted source line, which may hold a
secret. Which keys the mapping may hold is the loader's business (`kvtier.config`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError

__all__ = ["read_yaml_mapping", "yaml_problem"]


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that rejects a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, Hashable) and key in seen:
                raise ConfigError(f"{self.name}: {key}: duplicate key (line "
                                  f"{key_node.start_mark.line + 1}); give each key once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _StrictLoader.construct_mapping)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where (line, column), without the quoted source line PyYAML's own
    message carries: that line may hold a secret (`hash_salt: "unterminated...`)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return str(exc)  # a ReaderError: one bad character and its position, no line
    parts = []
    for what, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)):
        if what is None:
            continue
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        parts.append(f"{what}{where}")
    return "; ".join(parts) or type(exc).__name__


def read_yaml_mapping(path: Path) -> dict[Any, Any]:
    """The top-level mapping of the YAML file at `path` (used as given: no `~` expansion),
    keys and values as YAML gives them; {} for an empty file. `ConfigError` naming `path` when
    the file cannot be read, is not UTF-8, is not valid YAML, gives a key twice in one mapping
    or holds something other than a mapping at the top level. Keys are not checked."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: config file is not UTF-8 text (byte {exc.start}: "
                          f"{raw[exc.start:exc.start + 1]!r})") from None
    try:
        loader = _StrictLoader(text)
        loader.name = str(path)
        try:
            data = loader.get_single_data()  # type: ignore[no-untyped-call]
        finally:
            loader.dispose()  # type: ignore[no-untyped-call]
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return dict(data)
