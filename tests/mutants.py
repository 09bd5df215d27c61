"""The mutants of a module (for tests/mutation.py): one small change to its syntax tree each,
numbered in the order a walk of the tree meets them, so that a number names the same mutant
for as long as the module's source is the same.

The operators are the classic ones, each a bug a developer could write:
- a comparison flipped at its boundary or negated (`<` and `<=`, `==` and `!=`, `is` and
  `is not`, `in` and `not in`), `and` for `or`, a `not` dropped, a condition negated;
- a constant changed (True and False, a number plus one or doubled), arithmetic swapped
  (`+` and `-`, ...), `min` for `max`;
- a statement deleted (a call, an assignment, a `raise`, a `del`).
Never mutated: docstrings, annotations (not evaluated: `from __future__ import annotations`),
decorators, `assert` statements, `if TYPE_CHECKING:` blocks, Protocol classes, `__slots__`
and `__all__`.

`lua=True` mutates the Lua inside a module's strings instead (proxy/registry/scripts.py):
its comparisons, `and`/`or`, `+`/`-` and integers, as text.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType

_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_ARITH: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
}
_SYMBOL = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitAnd: "&",
}
_DELETABLE = (ast.Expr, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Raise, ast.Delete)
# Lua, as text: comparisons, logic, arithmetic, integers (comments after `--` left alone).
_LUA = re.compile(r"<=|>=|~=|==|<|>|\band\b|\bor\b|(?<=\s)[+-](?=\s)|\b\d+\b")
_LUA_SWAP = {
    "<": "<=",
    "<=": "<",
    ">": ">=",
    ">=": ">",
    "==": "~=",
    "~=": "==",
    "and": "or",
    "or": "and",
    "+": "-",
    "-": "+",
}


@dataclass(frozen=True)
class Mutant:
    key: str  # "<where>: <what>", unique in its module (a " #n" added to repeats)
    line: int
    end_line: int


def _text(node: ast.AST, limit: int = 70) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Walk(ast.NodeTransformer):
    """Meets the mutation points in a fixed order; replaces point `target` (if given)."""

    def __init__(self, target: int | None, lua: bool) -> None:
        self.target = target
        self.lua = lua
        self.count = 0
        self.found: list[tuple[str, int, int]] = []  # (where: what, line, end line)
        self.scope: list[str] = []
        self.in_class: list[bool] = [False]  # the innermost scope is a class body

    def point(self, node: ast.AST, what: str, make: Callable[[], ast.AST]) -> ast.AST | None:
        n = self.count
        self.count += 1
        if self.target is None:
            where = ".".join(self.scope) or "<module>"
            line = getattr(node, "lineno", 0)
            self.found.append((f"{where}: {what}", line, getattr(node, "end_lineno", line)))
            return None
        if n == self.target:
            return ast.copy_location(make(), node)
        return None

    # -- where a walk does not go ------------------------------------------------------------
    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        start = 1 if body and _is_docstring(body[0]) else 0
        return body[:start] + [s for stmt in body[start:] for s in _as_list(self.visit(stmt))]

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> ast.AST:
        if isinstance(node, ast.ClassDef) and _is_protocol(node):
            return node  # a type for the checker: nothing in it runs
        self.scope.append(node.name)
        self.in_class.append(isinstance(node, ast.ClassDef))
        try:
            if not isinstance(node, ast.ClassDef):
                args = node.args
                args.defaults = [self.visit(d) for d in args.defaults]
                args.kw_defaults = [d if d is None else self.visit(d) for d in args.kw_defaults]
            node.body = self._body(node.body)
        finally:
            self.scope.pop()
            self.in_class.pop()
        return node

    def visit_Module(self, node: ast.Module) -> ast.AST:
        node.body = self._body(node.body)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        return node

    # -- statements --------------------------------------------------------------------------
    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return node
        return self._branch(node)

    def visit_While(self, node: ast.While) -> ast.AST | list[ast.stmt]:
        return self._branch(node)

    def _branch(self, node: ast.If | ast.While) -> ast.AST:
        if not self.lua and not _is_not(node.test):
            negated = self.point(
                node,
                f"negate `{_text(node.test)}`",
                lambda: _replace(node, test=ast.UnaryOp(ast.Not(), node.test)),
            )
            if negated is not None:
                return negated
        node.test = self.visit(node.test)
        node.body = self._body(node.body)
        node.orelse = self._body(node.orelse)
        return node

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.stmt) and not self.lua:
            # `name: type` alone declares nothing at run time, but a class's field.
            declaration = isinstance(node, ast.AnnAssign) and node.value is None
            if isinstance(node, _DELETABLE) and not _keep(node):
                if declaration and not self.in_class[-1]:
                    return node
                gone = self.point(node, f"delete `{_text(node)}`", ast.Pass)
                if gone is not None:
                    return gone
            if isinstance(node, ast.AugAssign) and type(node.op) in _ARITH:
                swapped = _ARITH[type(node.op)]
                what = f"`{_text(node)}`: {_SYMBOL[type(node.op)]}= -> {_SYMBOL[swapped]}="
                new = self.point(node, what, lambda: _replace(node, op=swapped()))
                if new is not None:
                    return new
        if isinstance(node, ast.AnnAssign):  # the annotation is never evaluated
            node.value = node.value and self.visit(node.value)
            return node
        return super().generic_visit(node)

    # -- expressions -------------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        if not self.lua:
            for i, op in enumerate(node.ops):
                swapped = _COMPARE[type(op)]
                what = f"`{_text(node)}`: {_SYMBOL[type(op)]} -> {_SYMBOL[swapped]}"
                new = self.point(node, what, lambda i=i, s=swapped: _compare(node, i, s()))
                if new is not None:
                    return new
        return self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        if not self.lua:
            other = ast.Or if isinstance(node.op, ast.And) else ast.And
            what = f"`{_text(node)}`: {'and -> or' if other is ast.Or else 'or -> and'}"
            new = self.point(node, what, lambda: _replace(node, op=other()))
            if new is not None:
                return new
        return self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        if not self.lua and isinstance(node.op, ast.Not | ast.USub):
            new = self.point(node, f"`{_text(node)}`: drop the operator", lambda: node.operand)
            if new is not None:
                return new
        return self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> ast.AST:
        if not self.lua and not _is_not(node.test):
            new = self.point(
                node,
                f"negate `{_text(node.test)}` in `{_text(node, 40)}`",
                lambda: _replace(node, test=ast.UnaryOp(ast.Not(), node.test)),
            )
            if new is not None:
                return new
        return self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        if not self.lua and type(node.op) in _ARITH:
            swapped = _ARITH[type(node.op)]
            what = f"`{_text(node)}`: {_SYMBOL[type(node.op)]} -> {_SYMBOL[swapped]}"
            new = self.point(node, what, lambda: _replace(node, op=swapped()))
            if new is not None:
                return new
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        func = node.func
        if not self.lua and isinstance(func, ast.Name) and func.id in ("min", "max"):
            other = "max" if func.id == "min" else "min"
            what = f"`{_text(node)}`: {func.id} -> {other}"
            new = self.point(node, what, lambda: _replace(node, func=ast.Name(other, ast.Load())))
            if new is not None:
                return new
        return self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        value = node.value
        if self.lua:
            return self._lua(node) if isinstance(value, str) and "redis.call" in value else node
        new: ast.AST | None = None
        if isinstance(value, bool):
            new = self.point(node, f"`{value}` -> `{not value}`", lambda: ast.Constant(not value))
        elif isinstance(value, int):
            new = self.point(node, f"`{value}` -> `{value + 1}`", lambda: ast.Constant(value + 1))
        elif isinstance(value, float):
            other = value * 2 if value else 1.0
            new = self.point(node, f"`{value}` -> `{other}`", lambda: ast.Constant(other))
        return new or node

    def _lua(self, node: ast.Constant) -> ast.AST:
        text: str = node.value
        for match in _LUA.finditer(text):
            start, end = match.span()
            line_start = text.rfind("\n", 0, start) + 1
            if "--" in text[line_start:start]:
                continue  # a Lua comment
            token = match.group()
            other = _LUA_SWAP.get(token, str(int(token) + 1) if token.isdigit() else token)
            context = " ".join(text[max(line_start, start - 30) : end + 30].split("\n")[0].split())
            what = f"lua `{context}`: {token} -> {other} (at {start})"
            mutated = text[:start] + other + text[end:]
            new = self.point(node, what, lambda m=mutated: ast.Constant(m))
            if new is not None:
                return new
        return node


def _as_list(result: ast.AST | list[ast.stmt] | None) -> list[ast.stmt]:
    if result is None:
        return []
    return result if isinstance(result, list) else [result]  # type: ignore[list-item]


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _is_protocol(node: ast.ClassDef) -> bool:
    return any(getattr(base, "id", getattr(base, "attr", "")) == "Protocol" for base in node.bases)


def _is_not(node: ast.expr) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def _keep(stmt: ast.stmt) -> bool:
    """Statements whose deletion is no bug: `...` bodies, names only the tooling reads."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return True
    if isinstance(stmt, ast.Assign):
        names = {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        return bool(names & {"__slots__", "__all__"}) or _is_type_alias(stmt.value)
    return False


def _is_type_alias(value: ast.expr) -> bool:
    """`Ref = tuple[str, int]`, `Headers = list[tuple[bytes, bytes]]`: read by annotations."""
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr):
        return _is_type_alias(value.left) and _is_type_alias(value.right)
    if isinstance(value, ast.Subscript):
        value = value.value
    name = value.id if isinstance(value, ast.Name) else getattr(value, "attr", "")
    return name in {"tuple", "list", "dict", "set", "frozenset", "type", "Callable", "Iterable"}


def _replace(node: ast.AST, **fields: object) -> ast.AST:
    new = copy.copy(node)
    for name, value in fields.items():
        setattr(new, name, value)
    return new


def _compare(node: ast.Compare, i: int, op: ast.cmpop) -> ast.AST:
    ops = list(node.ops)
    ops[i] = op
    return _replace(node, ops=ops)


def _walk(path: Path, target: int | None, lua: bool) -> tuple[ast.Module, _Walk]:
    tree = ast.parse(path.read_text(), str(path))
    walk = _Walk(target, lua)
    walk.visit(tree)
    return tree, walk


def mutants(path: Path, *, lua: bool = False) -> list[Mutant]:
    _, walk = _walk(path, None, lua)
    seen: dict[str, int] = {}
    out: list[Mutant] = []
    for key, line, end_line in walk.found:
        seen[key] = seen.get(key, 0) + 1
        out.append(Mutant(key if seen[key] == 1 else f"{key} #{seen[key]}", line, end_line))
    return out


def mutated_code(path: Path, n: int, *, lua: bool = False) -> CodeType:
    """The module with mutant `n` applied, compiled (line numbers as in its file)."""
    tree, walk = _walk(path, n, lua)
    if walk.count <= n:
        raise IndexError(f"{path} has {walk.count} mutants, not {n + 1}")
    ast.fix_missing_locations(tree)
    return compile(tree, str(path), "exec")
