"""Every Triton kernel reads module-level numbers only as `tl.constexpr`: the CPU interpreter reads a
plain global, but the GPU compiler refuses it ("Cannot access global variable ... from within
@jit'ed function"), a failure only a GPU run would otherwise show (it happened, measurements.md 15)."""

from __future__ import annotations

import importlib
import pkgutil

import triton

import hf_sparsespec.kernels as kernels


def _jit_functions():
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.KernelInterface) and getattr(value, "fn", None) is not None:
                if value.fn.__module__ == module.__name__:
                    yield module, name, value.fn


def test_kernels_read_module_numbers_only_as_constexpr():
    found, plain = 0, []
    for module, name, fn in _jit_functions():
        found += 1
        for global_name in fn.__code__.co_names:
            value = vars(module).get(global_name)
            if isinstance(value, (bool, int, float)):
                plain.append(f"{module.__name__}.{name} reads {global_name} = {value!r}")
    assert found >= 15  # the kernels were found
    assert not plain, "wrap these in tl.constexpr (or pass them as kernel arguments): " + "; ".join(plain)
