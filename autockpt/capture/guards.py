"""Checks on traced values kept as guards in the fx graph: assertions, and raises on values.

fx refuses every truth test of a traced value (``bool(proxy)``), so a submodule whose
forward checks its input (openai/whisper's ``AudioEncoder``: ``assert x.shape[1:] ==
self.positional_embedding.shape``) used to become one opaque leaf, and its repeated blocks
could only be checkpointed all together. The truth test of an ``assert`` is different from
a branch: the statement either raises ``AssertionError`` or goes on to the next line, so
there is one path to trace, and the test itself is a value the graph can compute and check
at run time. :func:`raise_guard` recognises that truth test in the caller's bytecode and
records ``torch._assert(value, message)`` in the graph: every call of the captured module
(and every recomputation of a checkpointed segment) checks the same condition on its own
values and raises the same ``AssertionError`` with the same message when it fails.

NOTE [capture: checks on values]. A check on tensor *values* (``if torch.isnan(x).any():
raise ValueError(...)``, ``assert torch.isfinite(x).all()``, ``if x.abs().max() > t: raise``)
is one path to trace in the same way, whatever the error type and whichever way the test
goes: it is recorded as a call of :func:`value_check`'s function for that error type, which
raises ``error(message)`` when the condition takes the raising value on the call's own
values. Such a module could not be planned before at all: as a leaf, or with
``torch._assert``, the profile's fake step ran the truth test on fake tensors, where a value
has no truth, and planning was refused. The guard now passes when its condition has no
values (a fake or meta tensor): planning sizes the path that does not raise, the only one
that has a step to size. Real runs (measured steps, the result, each checkpoint recompute,
which sees the values the forward saw) check for real, and raise where the model raises.
The message is the raise's own when it is one constant string, else the check's location
and source line (a message built at run time is not computed in the graph). A check on
values syncs the device when it runs, as the model's own code did, and once more in each
recompute of its segment.

Where a check is about *shapes* only (every path from the condition to the model's tensors
goes through ``.shape``, ``.size()``, ``.dim()`` and the like), only an assertion's form
(``assert``, ``if not cond: raise AssertionError``) is a guard, as before; an ``if`` that
raises another error type on a shape still makes the module a leaf. Why the difference: a
module that raises on values failed planning, so guarding it changes no plan that exists;
one that raises ``ValueError`` on a shape was planned as a leaf, and in a Hugging Face body
that leaf can be what sends the model to its ``torch.export`` capture: guarding it would
move such models to another graph and change their plans.

Anything else still makes a leaf: an ``if`` whose branch computes (it changes the graph: fx
would need both paths), an ``or`` in an assertion, an error made by a call rather than a
class named in the code, and an assertion pytest has rewritten (a test module's own). A
guard never specialises the graph to the example inputs: the condition is recomputed from
the call's own values. From Python 3.13 on, a comparison can convert its own result to bool
inside the ``COMPARE_OP`` (where a tuple comparison also tests its items): that truth test is
not taken for a check's, and the module stays a leaf there (``if x.max() > t: raise``; a
test with no comparison, ``if torch.isnan(x).any():``, is a guard on every version).

Only a submodule's code is guarded (the fx tracer asks only there): a check in the root's
own code already has a whole answer. An assertion on shapes there is kept by
``torch.export``, which keeps every operation plannable, and a raise on values sends the
model to the units route (NOTE [nested: units]), which plans each block; guarding them would
move those models to an fx graph, changing their plans.
"""

from __future__ import annotations

import dis
import functools
import linecache
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import has_side_effect

_PROXY_BOOL = fx.Proxy.__bool__.__code__
_SKIPPED = frozenset({"CACHE", "EXTENDED_ARG", "NOP", "NOT_TAKEN", "TO_BOOL"})
"""Instructions between the truth test and what it decides (3.13's ``TO_BOOL`` runs the
test itself; 3.14's ``NOT_TAKEN`` marks a jump's fall-through)."""

_SHAPE_ATTRIBUTES = frozenset(
    {"shape", "ndim", "dtype", "device", "layout", "is_cuda", "is_sparse", "requires_grad"}
)
_SHAPE_METHODS = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "stride",
        "element_size",
        "storage_offset",
        "get_device",
        "is_contiguous",
        "is_floating_point",
        "is_complex",
    }
)
"""What a condition may read of a tensor and still be about its shape, not its values."""


def raise_guard(tracer: fx.Tracer, value: fx.Proxy) -> bool | None:
    """When the truth test of ``value`` decides a check in the code that asked for it
    (``Proxy.__bool__``'s caller) that the module docstring lists, record the check in
    ``tracer``'s graph and return the truth value under which the code goes on (the path
    traced); return None (nothing recorded) otherwise."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _PROXY_BOOL:
        frame = frame.f_back  # type: ignore[assignment]
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return None
    found = _raise_at(caller.f_code, caller.f_lasti, caller)
    if found is None:
        return None
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    error = found.error
    if _reads_values(value.node):
        source = linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()
        message = found.constant
        if message is None:
            message = f"check failed at {where}: `{source}`"
        tracer.create_proxy("call_function", value_check(error, found.when), (value, message), {})
        return not found.when
    if error is not AssertionError or found.when:
        return None
    # an assertion on shapes: the guard and message it has always had (plans keep their
    # fingerprints, which read the message)
    message = found.assertion_message or f"assertion failed at {where}"
    tracer.create_proxy("call_function", torch._assert, (value, message), {})
    return True


@functools.cache
def value_check(error: type[BaseException], when: bool) -> Callable[[Any, str], None]:
    """The graph's function for a check on values (NOTE [capture: checks on values]):
    raise ``error(message)`` when ``bool(condition)`` is ``when``; pass when the condition
    is a tensor with no values (fake or meta: planning sizes the path that goes on). One
    named function per error type and direction, so generated code can call it."""

    def check(condition: Any, message: str) -> None:
        if isinstance(condition, torch.Tensor) and (
            condition.is_meta or isinstance(condition, FakeTensor)
        ):
            return
        if bool(condition) is when:
            raise error(message)

    check.__name__ = check.__qualname__ = f"raise_{error.__name__}_if_{str(when).lower()}"
    return has_side_effect(check)


def _reads_values(node: fx.Node) -> bool:
    """Whether the condition ``node`` computes depends on a tensor's values: some path from
    it back to a tensor the graph holds (a buffer or parameter, or a graph input that an
    operation other than Python's operators reads on the way) passes through no read of a
    shape (:func:`_reads_shape`). A graph input tested through Python's operators alone is
    not taken for a value: it may be a number, and a check on it is one fx has always
    refused. (``x.shape.index(3)`` is about a shape; ``x.any()`` is about values.)"""
    seen: set[tuple[fx.Node, bool]] = set()
    stack = [(node, False)]
    while stack:
        n, computed = stack.pop()
        if (n, computed) in seen or _reads_shape(n):
            continue
        seen.add((n, computed))
        if n.op == "get_attr" or (n.op == "placeholder" and computed):
            return True
        python = n.op == "call_function" and _python_operator(n.target)
        stack.extend((i, computed or not python) for i in n.all_input_nodes)
    return False


_SHAPE_FUNCTIONS = (len, torch.numel, torch.is_floating_point, torch.is_complex)


def _reads_shape(n: fx.Node) -> bool:
    """Whether ``n`` reads a tensor's shape, dtype or device, not its values."""
    if n.op == "call_method":
        return n.target in _SHAPE_METHODS
    if n.op != "call_function":
        return False
    if n.target is getattr:
        return len(n.args) > 1 and n.args[1] in _SHAPE_ATTRIBUTES
    return any(n.target is f for f in _SHAPE_FUNCTIONS)


def _python_operator(target: Any) -> bool:
    """Python's own operators and builtins (``operator.gt``, ``getattr``, ``getitem``):
    they pass on what their operands are about."""
    return getattr(target, "__module__", None) in ("_operator", "operator", "builtins")


@dataclass(frozen=True)
class _Raise:
    """A raise statement a truth test decides."""

    when: bool
    """The truth value of the test that leads to the raise."""
    error: type[BaseException]
    """The class raised (an instance made of it, with a message or none)."""
    assertion_message: str
    """The message as assertions have always read it (:func:`_message`)."""
    constant: str | None
    """The message when the raise passes one constant string, else None."""


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> tuple[tuple[dis.Instruction, ...], dict[int, int]]:
    instructions = tuple(i for i in dis.get_instructions(code) if i.opname != "CACHE")
    return instructions, {inst.offset: n for n, inst in enumerate(instructions)}


def _raise_at(code: types.CodeType, offset: int, caller: types.FrameType) -> _Raise | None:
    """The raise statement that the truth test running at ``offset`` in ``code`` (``caller``'s
    code) decides: the test's jump leads to a raise on one of its two outcomes (the jump's
    target or the instruction after it), which loads an exception class and raises with no
    jump on the way. None when neither outcome raises, or both do (tracing would raise
    either way)."""
    instructions, index = _instructions(code)
    at = index.get(offset)
    at = None if at is None else _next(instructions, at)
    if at is None:
        return None
    jump = instructions[at]
    if not jump.opname.startswith("POP_JUMP") or jump.opname.endswith("NONE"):
        return None
    if jump.opname.endswith("IF_TRUE"):
        jumps_when = True
    elif jump.opname.endswith("IF_FALSE"):
        jumps_when = False
    else:
        return None
    target = index.get(jump.argval)
    outcomes = {
        jumps_when: None if target is None else _next(instructions, target),
        not jumps_when: _next(instructions, at + 1),
    }
    found = [
        _Raise(when, error, message, _constant_message(instructions, i + 1))
        for when, i in outcomes.items()
        if i is not None
        and (error := _error_class(instructions[i], caller)) is not None
        and (message := _message(instructions, i + 1)) is not None
    ]
    return found[0] if len(found) == 1 else None


def _next(instructions: tuple[dis.Instruction, ...], at: int) -> int | None:
    """The index of the first instruction from ``at`` on that does something."""
    while at < len(instructions) and instructions[at].opname in _SKIPPED:
        at += 1
    return at if at < len(instructions) else None


def _error_class(inst: dis.Instruction, caller: types.FrameType) -> type[BaseException] | None:
    """The exception class ``inst`` loads: ``AssertionError``'s own instruction, 3.14's
    common constants, or a global name resolved in ``caller``'s globals and builtins as the
    raise would; None for any other instruction or value."""
    if inst.opname == "LOAD_ASSERTION_ERROR":
        return AssertionError
    if inst.opname == "LOAD_COMMON_CONSTANT":
        found: Any = inst.argval
    elif inst.opname != "LOAD_GLOBAL":
        return None
    else:
        name = str(inst.argval).removeprefix("NULL + ").removesuffix(" + NULL")
        found = caller.f_globals.get(name, caller.f_builtins.get(name))
    if isinstance(found, type) and issubclass(found, BaseException):
        return found
    return None


def _message(instructions: tuple[dis.Instruction, ...], at: int) -> str | None:
    """What follows the load of the error's class at ``at - 1``: the message when it starts
    with a constant string (how assertions have always read it), else "", provided the
    statement raises with no jump on the way (``RAISE_VARARGS``, possibly after building a
    message and calling the error type); None when it may not raise."""
    first = instructions[at] if at < len(instructions) else None
    for inst in instructions[at:]:
        if inst.opname == "RAISE_VARARGS":
            if first is not None and first.opname == "LOAD_CONST":
                return first.argval if isinstance(first.argval, str) else ""
            return ""
        if any(word in inst.opname for word in ("JUMP", "RETURN", "YIELD", "STORE")):
            return None
    return None


_CALLS = frozenset({"PRECALL", "CALL", "CALL_FUNCTION", "PUSH_NULL"})
"""A call of the error's class (on 3.11 and 3.12 an assertion's reads ``CALL 0``)."""


def _constant_message(instructions: tuple[dis.Instruction, ...], at: int) -> str | None:
    """The message when the statement from ``at`` on is exactly ``raise Error("text")``: one
    constant string, the call, the raise (an f-string or a second argument: None)."""
    rest = [i for i in instructions[at:] if i.opname not in _SKIPPED]
    end = next((k for k, inst in enumerate(rest) if inst.opname == "RAISE_VARARGS"), None)
    if end is None or end < 2 or rest[0].opname != "LOAD_CONST":
        return None
    if not isinstance(rest[0].argval, str) or rest[end].arg != 1:
        return None
    if any(inst.opname not in _CALLS for inst in rest[1:end]):
        return None
    return rest[0].argval
