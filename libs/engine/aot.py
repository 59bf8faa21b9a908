"""The compiled forward's graphs, compiled ahead of time and kept on disk (``engine.compile_aot``).

Owned by :class:`~libs.engine.model_runner.ModelRunner` when ``engine.compile`` and
``engine.compile_aot`` are on; the runner calls :meth:`AotForward.run` for every compiled step.
A process that finds a graph on disk loads it in a few seconds: no Python bytecode is traced
again, which is what a warm ``torch.compile`` spends most of its ~40 s on (decision 0017).

Each graph (one token; several) is one file named by :func:`graph_key` and the shape class.
The key covers everything that decides the graph without being one of its inputs: the engine
settings that shape it, the thread count, torch's and transformers' versions, this CPU's
features, the source of every module that shapes the graph, and the model's structure (module
tree, parameter names, shapes and dtypes). The weights themselves are inputs: a graph built for
one checkpoint serves another of the same structure. A graph that does not load, or whose
guards reject the first real inputs, is compiled again and replaces the file; it is never run.

With ``background`` (``engine.compile_background``, a serving worker) a graph that has to be
compiled is compiled on a thread of its own while :meth:`AotForward.run` answers ``None`` and
the runner runs those steps eagerly; the next step of its class after the compile swaps it in
(decision 0037). Without it (``strait up``'s warm-up child, tests) the compile happens before
``run`` returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import itertools
import json
import logging
import os
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from libs.engine.config import EngineSettings
from libs.engine.digest import engine_digest

log = logging.getLogger("strait.engine")

# Name of the model in the entry's globals: the compiled graph reads its parameters from there,
# and saving hands it over as external data (the weights never go into the file).
MODEL_GLOBAL = "_strait_model"
# A graph file no engine loaded or saved for this long is deleted at the next save (a file's
# mtime is touched at every load): a changed key leaves its old files behind otherwise.
UNUSED_GRAPH_MAX_AGE_S = 14 * 24 * 3600
# Bump when the file layout or the entry changes.
FORMAT = 1


def model_structure(model: torch.nn.Module) -> str:
    """The module tree (classes and their settings) and every parameter's and buffer's name,
    shape and dtype: what the graph assumes of the model beyond the tensors it reads."""
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    lines = [repr(model)]
    lines += [f"{n} {tuple(t.shape)} {t.dtype}" for n, t in tensors]
    config = model.config.to_dict()  # type: ignore[union-attr,operator]
    config.pop("_name_or_path", None)
    lines.append(json.dumps(config, sort_keys=True, default=str))
    return "\n".join(lines)


def graph_key(model: torch.nn.Module, settings: EngineSettings) -> str:
    """A short hash of everything that decides the compiled graphs (see the module)."""
    h = hashlib.sha256(f"format {FORMAT}\n".encode())
    h.update(engine_digest(settings))
    h.update(model_structure(model).encode())
    return h.hexdigest()[:20]


def prune(directory: Path, max_age_s: float = UNUSED_GRAPH_MAX_AGE_S) -> list[Path]:
    """Delete the graphs (and sidecars) no engine has loaded or saved for ``max_age_s``: those
    of old keys, which nothing will load again. Called after each save; returns what went."""
    cutoff = time.time() - max_age_s
    gone = []
    for f in directory.glob("*.pt"):
        with contextlib.suppress(OSError):
            if f.stat().st_mtime < cutoff:
                f.unlink()
                f.with_suffix(".json").unlink(missing_ok=True)
                gone.append(f)
    return gone


def default_dir() -> Path:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, which ``strait up`` sets for
    its children), ``strait-aot`` under it."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "strait-aot"


def _entry(model: torch.nn.Module) -> tuple[Callable[..., Any], dict[str, Any]]:
    """A fresh ``entry(**inputs) -> model(**inputs)`` whose globals hold ``model``; dynamo
    records the modules it reaches through those globals, which a load must hand back."""

    source = f"def entry(**inputs):\n    return {MODEL_GLOBAL}(**inputs)\n"
    code = compile(source, "<strait-aot-entry>", "exec")
    fn_code = next(c for c in code.co_consts if isinstance(c, types.CodeType))
    g: dict[str, Any] = {"__builtins__": __builtins__, MODEL_GLOBAL: model}
    return types.FunctionType(fn_code, g, "entry"), g


class AotForward:
    """The runner's two compiled graphs: loaded from ``directory`` when there, compiled from an
    example of the step's inputs and saved there when not."""

    def __init__(
        self,
        model: torch.nn.Module,
        settings: EngineSettings,
        directory: Path | None = None,
        background: bool = False,
    ) -> None:
        self.model = model
        self.key = graph_key(model, settings)
        self.dir = directory or default_dir()
        self.background = background
        self.graphs: dict[bool, Any] = {}  # one token? -> AOTCompiledFunction, in use
        self.loaded: set[bool] = set()  # graphs read from disk (not compiled by this process)
        self._tried: set[bool] = set()  # classes whose file was looked for
        # Background compiles: classes queued or compiling, graphs compiled and not yet
        # checked against a step, classes whose compile failed (those steps stay eager).
        self._lock = threading.Lock()
        self._queue: list[tuple[bool, dict[str, Any]]] = []
        self._compiling: set[bool] = set()
        self._fresh: dict[bool, Any] = {}
        self.failed: set[bool] = set()
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> str:
        """What the steps run: "compiling" while a graph compiles (its steps run eager),
        "eager" when a compile failed, else "compiled"."""
        with self._lock:
            if self._compiling or self._fresh:
                return "compiling"
        return "eager" if self.failed else "compiled"

    def path(self, one: bool) -> Path:
        return self.dir / f"{self.key}-{'one' if one else 'many'}.pt"

    def run(
        self, one: bool, inputs: dict[str, Any], example: Callable[[], dict[str, Any]]
    ) -> Any | None:
        """The forward over ``inputs`` through the graph of its shape class, or ``None`` when
        that class has no graph yet (``background``: one is compiling; run the step eagerly).
        The first call of a class loads its graph, or compiles it from ``example()`` (fresh
        tensors, their varying sizes marked dynamic) and saves it; a graph is checked against
        every guard once, on the first step it would serve; later calls check none (nothing
        they test changes after start; the runner picks the class)."""
        fn = self.graphs.get(one)
        if fn is not None:
            return fn(**inputs)
        fn = self._candidate(one, inputs)
        if fn is None:
            if self.background:
                self._compile_later(one, example)
                return None
            fn = self._compile(one, example())
            if not fn.guard_check(**inputs):
                raise RuntimeError("engine.compile_aot: a fresh graph rejects the step it serves")
        fn.disable_guard_check()
        self.graphs[one] = fn
        return fn(**inputs)

    def _candidate(self, one: bool, inputs: dict[str, Any]) -> Any | None:
        """A graph of class ``one`` that fits ``inputs``: the one on disk (looked for once), or
        the one a background compile left; ``None`` when there is none."""
        with self._lock:
            fn = self._fresh.pop(one, None)
        if fn is not None:
            if self._fits(fn, inputs, "a graph compiled here"):
                return fn
            self.failed.add(one)  # never compiled again in a loop: this class stays eager
            return None
        if one in self._tried:
            return None
        self._tried.add(one)
        fn = self._load(one)
        if fn is not None and self._fits(fn, inputs, str(self.path(one))):
            self.loaded.add(one)
            return fn
        return None

    @staticmethod
    def _fits(fn: Any, inputs: dict[str, Any], what: str) -> bool:
        if fn.guard_check(**inputs):
            return True
        reason = fn._artifacts.guard_manager.check_verbose(fn.prepare_f_locals(**inputs))
        log.warning(
            "engine.compile_aot: %s does not fit this engine (%s); compiling",
            what,
            str(getattr(reason, "verbose_code_parts", reason))[:400],
        )
        return False

    def _compile_later(self, one: bool, example: Callable[[], dict[str, Any]]) -> None:
        """Queue class ``one`` for the background thread (once; never after a failure)."""
        with self._lock:
            if one in self._compiling or one in self.failed:
                return
            self._compiling.add(one)
            self._queue.append((one, example()))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._compile_queued, name="strait-compile", daemon=True
                )
                self._thread.start()
        log.warning(
            "engine.compile_aot: compiling the %s graph in the background; its steps run "
            "eager until it is ready",
            "one-token" if one else "several-token",
        )

    def _compile_queued(self) -> None:
        """The background thread: compile the queued classes one after another (under
        inference mode, as the engine's steps run: the graphs' guards check it)."""
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                one, example = self._queue.pop(0)
            fn = None
            try:
                with torch.inference_mode():
                    fn = self._compile(one, example)
            except Exception:
                log.exception("engine.compile_aot: the background compile failed; running eager")
            with self._lock:
                self._compiling.discard(one)
                if fn is None:
                    self.failed.add(one)
                else:
                    self._fresh[one] = fn

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until no background compile is queued or running (tests, benchmarks); True
        when none is left."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()

    def _load(self, one: bool) -> Any | None:
        path = self.path(one)
        if not path.exists():
            return None
        t0 = time.perf_counter()
        try:
            refs = json.loads(path.with_suffix(".json").read_text())
            # The modules dynamo reached through the entry's globals, under the names it gave them.
            f_globals: dict[str, Any] = {MODEL_GLOBAL: self.model}
            for name, module in refs["modules"].items():
                f_globals[name] = importlib.import_module(module)
            with path.open("rb") as f:
                fn = torch.compiler.load_compiled_function(
                    f, f_globals=f_globals, external_data={MODEL_GLOBAL: self.model}
                )
        except Exception as e:  # any unreadable artifact is rebuilt, never fatal
            log.warning("engine.compile_aot: cannot load %s (%s); compiling", path, e)
            return None
        log.info("engine.compile_aot: loaded %s in %.1f s", path.name, time.perf_counter() - t0)
        with contextlib.suppress(OSError):  # in use: not pruned (see prune)
            os.utime(path)
        return fn

    def _compile(self, one: bool, example: dict[str, Any]) -> Any:
        entry, g = _entry(self.model)
        compiled = torch.compile(
            entry,
            fullgraph=True,
            options={
                "cpp_wrapper": True,
                # Only guards that survive a save (tensor sizes, dtypes, devices); the rest test
                # the model's modules, which the key covers and which never change after start.
                "guard_filter_fn": torch.compiler.keep_portable_guards_unsafe,
            },
        )
        t0 = time.perf_counter()
        fn = compiled.aot_compile(((), example))  # type: ignore[attr-defined]
        log.info(
            "engine.compile_aot: compiled the %s graph in %.1f s",
            "one-token" if one else "several-token",
            time.perf_counter() - t0,
        )
        modules = {
            k: v.__name__ for k, v in g.items() if k.startswith("___") and isinstance(v, ModuleType)
        }
        path = self.path(one)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # The sidecar first: a graph file on disk always has its sidecar (both atomic).
            tmp = path.with_suffix(f".json.{os.getpid()}")
            tmp.write_text(json.dumps({"modules": modules}))
            tmp.replace(path.with_suffix(".json"))
            fn.save_compiled_function(str(path), external_data={MODEL_GLOBAL: self.model})
            prune(self.dir)
        except Exception as e:  # an unwritable cache costs a compile next start
            log.warning("engine.compile_aot: cannot save %s (%s)", path, e)
        return fn
