"""Discoverability: `zerodp config`'s text, every key with its type, default and docstring, read from
the schema's source (zerodp.config.schema) so that the docs stay where a reader of the code sees them.
Torch-free."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import yaml

from zerodp.config.schema import Config, _field_types, _section_types


@dataclass
class FieldDoc:
    key: str
    """`section.key`, as written in overrides."""
    type: str
    default: Any
    doc: str


def field_docs() -> list[FieldDoc]:
    """Every config key with its type, default and docstring, in declaration order.

    The docstrings are the string literals under each field in this file (read with `ast`, so they
    stay where a reader of the code sees them); a field whose doc continues the previous one's
    sentence (`...`) shares it."""
    import ast
    import inspect

    docs: dict[tuple[str, str], str] = {}
    tree = ast.parse(inspect.getsource(inspect.getmodule(Config)))
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    docs[(node.name, stmt.target.id)] = " ".join(nxt.value.value.split())
    out = []
    defaults = Config()
    for section, cls in _section_types().items():
        for name, typ in _field_types(cls).items():
            out.append(FieldDoc(f"{section}.{name}", _type_name(typ), getattr(getattr(defaults, section), name),
                                docs.get((cls.__name__, name), "")))
    return out


def _type_name(typ: Any) -> str:
    if typing.get_origin(typ) is typing.Union and set(typing.get_args(typ)) == {int, str}:
        return "int or auto"
    if typing.get_origin(typ) is typing.Union and set(typing.get_args(typ)) == {bool, str}:
        return "bool or str"
    if typing.get_origin(typ) is typing.Union:
        (inner,) = [a for a in typing.get_args(typ) if a is not type(None)]
        return f"{_type_name(inner)} or null"
    return {dict: "mapping", list: "list"}.get(typ, getattr(typ, "__name__", str(typ)))


def format_field_docs(section: str | None = None) -> str:
    """`zerodp config`'s text: keys grouped by section, each with type, default and what it does."""
    lines, current = [], None
    for f in field_docs():
        sec = f.key.split(".", 1)[0]
        if section is not None and sec != section:
            continue
        if sec != current:
            if current is not None:
                lines.append("")
            lines.append(f"{sec}:")
            current = sec
        default = yaml.safe_dump(f.default, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"  {f.key} ({f.type}, default {default})")
        if f.doc:
            lines.append(f"      {f.doc}")
    return "\n".join(lines)
