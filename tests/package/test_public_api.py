"""The public surface: an explicit, sorted, complete `__all__`; import needs no GPU."""

from __future__ import annotations

import subprocess
import sys

import kvasync


def test_all_is_sorted_and_complete() -> None:
    assert kvasync.__all__ == sorted(kvasync.__all__)
    public = {n for n in dir(kvasync) if not n.startswith("_")}
    modules = {"bench", "compat", "metrics", "remote", "serve"}  # submodules, set once imported
    assert public - modules - {"annotations"} == set(kvasync.__all__)
    for name in kvasync.__all__:
        assert getattr(kvasync, name).__module__ == "kvasync", name


def test_import_needs_no_driver_and_touches_no_cuda() -> None:
    """Import in a fresh interpreter: no cupy/torch import, no CUDA handle created."""
    code = (
        "import sys, kvasync, kvasync.compat.vllm;"
        "assert 'cupy' not in sys.modules, 'cupy imported';"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "import kvasync._backends._host, kvasync.metrics;"
        "assert 'prometheus_client' not in sys.modules, 'prometheus_client imported';"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_cuda_backend_module_imports_without_a_driver() -> None:
    """With or without cupy installed, importing the CUDA backend must not need a driver."""
    code = "import kvasync._backends as b; import importlib; importlib.import_module('kvasync._backends._cuda'); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_compat_all() -> None:
    from kvasync.compat import vllm

    assert vllm.__all__ == sorted(vllm.__all__)
    for name in vllm.__all__:
        assert hasattr(vllm, name)
    assert "vllm" not in sys.modules
