"""Assert statements on traced values kept as guards in the fx graph.

fx refuses every truth test of a traced value (``bool(proxy)``), so a submodule whose
forward checks its input (openai/whisper's ``AudioEncoder``: ``assert x.shape[1:] ==
self.positional_embedding.shape``) used to become one opaque leaf, and its repeated blocks
could only be checkpointed all together. The truth test of an ``assert`` is different from
a branch: the statement either raises ``AssertionError`` or goes on to the next line, so
there is one path to trace, and the test itself is a value the graph can compute and check
at run time. :func:`assert_guard` recognises that truth test in the caller's bytecode and
records ``torch._assert(value, message)`` in the graph: every call of the captured module
(and every recomputation of a checkpointed segment) checks the same condition on its own
values and raises the same ``AssertionError`` with the same message when it fails.

Only ``assert`` statements (and ``if not cond: raise AssertionError``, which compiles the
same way) are recognised: an ``if`` whose branch raises another error type, or computes
anything, still makes the module a leaf, and so does an assertion pytest has rewritten (a
test module's own). A guard never specialises the graph to the example inputs' shapes: the
condition is recomputed from the call's own values. An assertion on tensor values
(``assert torch.isfinite(x).all()``) is a guard too, but planning sizes a step on fake
tensors, where a value has no truth: such a model is refused with a ``TraceError`` naming
the guard, as it was when the module was a leaf (the fake step ran the leaf's code). From Python 3.13 on, a comparison can
convert its own result to bool inside the ``COMPARE_OP`` (where a tuple comparison also
tests its items): that truth test is not taken for an assertion's, and the module stays a
leaf there.

Only a submodule's code is guarded (the fx tracer asks only there): an assertion in the
root's own code (nanoGPT's length check) already has a whole answer, ``torch.export``, which
keeps every operation plannable, and guarding it would move those models from the export
graph they are planned on today to an fx graph, changing their plans.
"""

from __future__ import annotations

import dis
import functools
import sys
import types
from typing import Any

import torch
import torch.fx as fx

_PROXY_BOOL = fx.Proxy.__bool__.__code__
_SKIPPED = frozenset({"CACHE", "EXTENDED_ARG", "NOP", "NOT_TAKEN", "TO_BOOL"})
"""Instructions between the truth test and what it decides (3.13's ``TO_BOOL`` runs the
test itself; 3.14's ``NOT_TAKEN`` marks a jump's fall-through)."""


def assert_guard(tracer: fx.Tracer, value: fx.Proxy) -> bool:
    """Record ``torch._assert(value, message)`` in ``tracer``'s graph and return True when
    the truth test of ``value`` is the condition of an ``assert`` in the code that asked for
    it (``Proxy.__bool__``'s caller); return False (nothing recorded) otherwise."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not _PROXY_BOOL:
        frame = frame.f_back  # type: ignore[assignment]
    caller = frame.f_back if frame is not None else None
    if caller is None:
        return False
    found = _assertion_at(caller.f_code, caller.f_lasti)
    if found is None:
        return False
    message = found or f"assertion failed at {caller.f_code.co_filename}:{caller.f_lineno}"
    tracer.create_proxy("call_function", torch._assert, (value, message), {})
    return True


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> tuple[tuple[dis.Instruction, ...], dict[int, int]]:
    instructions = tuple(i for i in dis.get_instructions(code) if i.opname != "CACHE")
    return instructions, {inst.offset: n for n, inst in enumerate(instructions)}


def _assertion_at(code: types.CodeType, offset: int) -> str | None:
    """The message of the assertion whose truth test runs at ``offset`` in ``code`` ("" when
    it has none that is a constant string), or None when that truth test is not an
    assertion's: a jump that skips a raise of ``AssertionError`` when the value is truthy,
    or jumps to one when it is falsy."""
    instructions, index = _instructions(code)
    at = index.get(offset)
    if at is None:
        return None
    at = _next(instructions, at)
    if at is None:
        return None
    jump = instructions[at]
    if not jump.opname.startswith("POP_JUMP") or jump.opname.endswith("NONE"):
        return None
    if jump.opname.endswith("IF_TRUE"):
        raise_at = _next(instructions, at + 1)
    elif jump.opname.endswith("IF_FALSE"):
        raise_at = index.get(jump.argval)
        raise_at = None if raise_at is None else _next(instructions, raise_at)
    else:
        return None
    if raise_at is None or not _loads_assertion_error(instructions[raise_at]):
        return None
    return _message(instructions, raise_at + 1)


def _next(instructions: tuple[dis.Instruction, ...], at: int) -> int | None:
    """The index of the first instruction from ``at`` on that does something."""
    while at < len(instructions) and instructions[at].opname in _SKIPPED:
        at += 1
    return at if at < len(instructions) else None


def _loads_assertion_error(inst: dis.Instruction) -> bool:
    if inst.opname == "LOAD_ASSERTION_ERROR":
        return True
    return inst.opname in ("LOAD_GLOBAL", "LOAD_COMMON_CONSTANT") and _named_assertion(inst.argval)


def _named_assertion(argval: Any) -> bool:
    return argval is AssertionError or (
        isinstance(argval, str) and argval.removeprefix("NULL + ") == "AssertionError"
    )


def _message(instructions: tuple[dis.Instruction, ...], at: int) -> str | None:
    """What follows the load of ``AssertionError`` at ``at - 1``: the assertion's message
    when it is a constant string, else "", provided the statement raises with no jump on the
    way (``RAISE_VARARGS``, possibly after building a message and calling the error type);
    None when it may not raise."""
    first = instructions[at] if at < len(instructions) else None
    for inst in instructions[at:]:
        if inst.opname == "RAISE_VARARGS":
            if first is not None and first.opname == "LOAD_CONST":
                return first.argval if isinstance(first.argval, str) else ""
            return ""
        if any(word in inst.opname for word in ("JUMP", "RETURN", "YIELD", "STORE")):
            return None
    return None
