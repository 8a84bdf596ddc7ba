"""Zero-code-change injection: the launchers put `inject/sitecustomize.py` on the job's
PYTHONPATH; it calls `install()`, which wraps Horovod's optimizer factories and DDP's
constructor as soon as the training script imports them, so an unmodified script runs
under crossover.

Loud by design: a patch that fails stops the process with the reason, and a process
that imported Horovod but never built a wrapped optimizer says so at exit.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType

from crossover import environment as E

INJECT_ENV = E.INJECT
#: Module name -> (factory attribute, adapter module) to wrap on import.
TARGETS: dict[str, list[tuple[str, str | None]]] = {
    "horovod.torch": [("DistributedOptimizer", "crossover.hooks.torch")],
    "horovod.tensorflow.keras": [("DistributedOptimizer", "crossover.hooks.keras")],
    "horovod.tensorflow": [("DistributedGradientTape", "crossover.hooks.keras")],
    # a class: its __init__ is wrapped, so isinstance() and subclasses still work
    "torch.nn.parallel.distributed": [("DistributedDataParallel", "crossover.hooks.ddp")],
    # no adapter: a call only marks the process as a distributed job (for the exit report)
    "torch.distributed.distributed_c10d": [("init_process_group", None)],
}

_wrapped: list[str] = []  # factories that produced a wrapped object in this process
_imported: list[str] = []


def _wrap_factory(module: ModuleType, attr: str, adapter: str | None) -> None:
    factory = getattr(module, attr)
    if adapter is None:
        _note_call(module, attr)
        return
    if isinstance(factory, type):
        _wrap_init(factory, f"{module.__name__}.{attr}", adapter)
        return
    if getattr(factory, "_crossover_injected", False):
        return

    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        obj = factory(*args, **kwargs)
        hooks = importlib.import_module(adapter)
        _wrapped.append(f"{module.__name__}.{attr}")
        return hooks.wrap(obj)

    wrapped._crossover_injected = True
    setattr(module, attr, wrapped)


def _note_call(module: ModuleType, attr: str) -> None:
    """Count a call of `attr` as an import of a framework that should be wrapped: every
    torch process imports DDP's module, only a distributed job starts a process group."""
    func = getattr(module, attr)
    if getattr(func, "_crossover_injected", False):
        return

    @functools.wraps(func)
    def noted(*args, **kwargs):
        _imported.append(f"{module.__name__}.{attr}")
        return func(*args, **kwargs)

    noted._crossover_injected = True
    setattr(module, attr, noted)


def _wrap_init(cls: type, name: str, adapter: str) -> None:
    """Wrap every instance of `cls` once its own __init__ is done."""
    init = cls.__init__
    if getattr(init, "_crossover_injected", False):
        return

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _wrapped.append(name)
        importlib.import_module(adapter).wrap(self)  # once, even for a subclass

    wrapped._crossover_injected = True
    cls.__init__ = wrapped


def _patch(module: ModuleType) -> None:
    if not module.__name__.startswith("torch."):  # every torch process imports DDP's
        _imported.append(module.__name__)
    for attr, adapter in TARGETS[module.__name__]:
        try:
            _wrap_factory(module, attr, adapter)
        except Exception as exc:  # noqa: BLE001 - any failure must stop the job, loudly
            raise SystemExit(
                f"crossover: could not hook {module.__name__}.{attr} ({exc!r}); the job "
                f"would run without crossover. Run it without --crossover, or report this."
            ) from exc


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the module."""

    def __init__(self, inner: importlib.abc.Loader, after: Callable[[ModuleType], None]):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.after(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Intercepts the imports named in TARGETS (once each) and wraps their loader."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name not in TARGETS or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, _patch)
        return spec


def _report_at_exit() -> None:
    # Not with crossover off: the hooks then wrap nothing on purpose (a bad value of
    # CROSSOVER_ENABLE is off too, and was said already)
    if _imported and not _wrapped and E.enabled():
        print(f"crossover: WARNING: this process used {', '.join(_imported)} but built no "
              f"Horovod DistributedOptimizer or DistributedGradientTape and no "
              f"DistributedDataParallel model (FSDP and tensor parallelism are not served), "
              f"so it ran without crossover", file=sys.stderr, flush=True)


def install() -> None:
    """Hook the Horovod modules in this process (idempotent)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    for name in TARGETS:  # imported already (unusual at start-up): patch in place
        if name in sys.modules:
            _patch(sys.modules[name])
    sys.meta_path.insert(0, _Finder())
    atexit.register(_report_at_exit)


def inject_dir() -> str:
    """The directory to put first on a job's PYTHONPATH."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject")
