"""Triton's interpreter (``TRITON_INTERPRET=1``) without two kinds of work whose results it never uses.

The interpreter is how the tests, ``sdma-kernels-report`` and the launch counts run SDMA's Triton kernels on a CPU.
One fairseq SDMA-T training step there (the kernels report's recording, tiny 2+2) took 26-32 s before and 11-14 s
after, run back to back (triton 3.6.0, 2 cores). Kernel results are unchanged: neither skipped piece of work has an
effect.

1. Integer overflow checks. Each ``+``, ``-`` and ``*`` of int32 values in a kernel (every offset and index) is
   recomputed in int64 and compared with the int32 range to build a ``device_assert``, and ``device_assert`` returns
   before using it unless the options say ``debug``, which the interpreter's never do. So ``sanitize_overflow`` is
   turned off while ``debug`` is off.
2. Patching the language again at each call of a ``@triton.jit`` helper. A kernel's call of a helper runs
   ``_patch_lang`` (``inspect.getmembers`` over ``triton.language``), once per program and loop step. Nothing undoes
   those patches before the launch ends, so a helper's second and later calls within one launch patch nothing new;
   they are skipped. The launch's own patching, and its undoing at the launch's end, are as before.
"""

import dataclasses

_MARK = "_latent_core_once_per_launch"


def lighten_interpreter() -> None:
    """Apply both (idempotent). Does nothing to a Triton whose interpreter lacks what it changes."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not getattr(options, "debug", True) and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, _MARK, False):
        return
    patched = set()  # the functions patched for the launch under way (empty between launches)

    def patch_lang_once_per_launch(fn):
        if fn in patched:
            return None  # a helper called again: its patches are still in place (the helper call ignores this)
        scope = patch_lang(fn)
        if not patched:  # no launch under way: this is one starting (GridExecutor keeps the scope, undoes it at the end)
            undo = scope.restore

            def restore():
                patched.clear()
                undo()

            scope.restore = restore
        patched.add(fn)
        return scope

    setattr(patch_lang_once_per_launch, _MARK, True)
    interpreter._patch_lang = patch_lang_once_per_launch
