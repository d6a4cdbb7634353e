"""One capture per model per test worker: ``rnnify.convert`` of a model identical to one it captured
before reuses that graph.

Most of the suite's time went to ``torch.export``, and most of that to capturing a model it had
captured already: the tiny llama converted to each target by a hundred tests, a tiny family converted
by each test of its file. A capture depends on the model alone (its class, config, module attributes
and tensors), so a model whose every one of those equals a captured one's gets a copy of that graph,
its tensors bound to the model's own exactly where the first capture's were bound to its model's.
Everything after the capture (the passes, the cells, the check against the original) runs as always.

A test that patches anything (``monkeypatch``, ``pytest.MonkeyPatch.context``) may be patching what
export sees: from its first patch on, that test captures afresh and keeps nothing. So does a model
with a method set on one of its modules.
"""

from __future__ import annotations

import copy
import hashlib
import os

import pytest
import torch

import rnnify.compiler.convert as convert_module

_capture = convert_module.capture
_graphs: dict[str, tuple[torch.fx.GraphModule, dict[tuple[str, str, str], str]]] = {}
_patched = False
_PLAIN = (bool, int, float, str, type(None), tuple, list)
_MODULES = (torch.nn.Module, type)


def new_test() -> None:
    """A test starts: nothing patched yet."""
    global _patched
    _patched = False


def install() -> None:
    """Route ``rnnify.convert``'s capture through the cache and note every patch a test makes."""
    convert_module.capture = capture
    for method in ("setattr", "delattr", "setitem", "delitem"):
        setattr(pytest.MonkeyPatch, method, _noting(getattr(pytest.MonkeyPatch, method)))


def _noting(method):
    def patched(self, target, *args, **kwargs):
        global _patched
        if target is not os.environ:  # setenv and delenv go through setitem and delitem
            _patched = True
        return method(self, target, *args, **kwargs)

    return patched


def capture(model: torch.nn.Module) -> torch.fx.GraphModule:
    key = None if _patched else _key(model)
    if key is None:
        return _capture(model)
    if key not in _graphs:
        graph = _capture(model)
        _graphs[key] = copy.deepcopy(graph), _aliases(graph, model)
        return graph
    cached, aliases = _graphs[key]
    graph = copy.deepcopy(cached)
    own = _named_tensors(model)
    for (prefix, kind, name), source in aliases.items():
        getattr(graph.get_submodule(prefix), kind)[name] = own[source]
    return graph


def _key(model: torch.nn.Module) -> str | None:
    """A digest of everything a capture of ``model`` reads, or None for a model with a method of its own."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    digest.update(repr(sorted(vars(model.config).items(), key=lambda item: item[0])).encode())
    for path, module in model.named_modules(remove_duplicate=False):
        attributes = {k: v for k, v in vars(module).items() if not k.startswith("_")}
        if any(callable(v) and hasattr(type(module), k) for k, v in attributes.items()):
            return None  # a method of the module's own, replacing its class's
        plain = sorted((k, v) for k, v in attributes.items() if isinstance(v, _PLAIN))
        functions = sorted((k, _name(v)) for k, v in attributes.items() if callable(v) and not isinstance(v, _MODULES))
        digest.update(f"{path}:{type(module).__qualname__}:{plain!r}:{functions!r}".encode())
    for name, tensor in _named_tensors(model).items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{tensor.device}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _name(function) -> str:
    return f"{getattr(function, '__module__', '')}.{getattr(function, '__qualname__', type(function).__qualname__)}"


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def _aliases(graph: torch.fx.GraphModule, model: torch.nn.Module) -> dict[tuple[str, str, str], str]:
    """``(submodule, "_parameters" or "_buffers", name) -> the model's tensor name`` for each tensor
    of ``graph`` that is one of ``model``'s."""
    by_storage = {(t.data_ptr(), t.dtype, tuple(t.shape)): name for name, t in _named_tensors(model).items()}
    aliases = {}
    for prefix, module in graph.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is None:
                    continue
                source = by_storage.get((tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)))
                if source is not None:
                    aliases[prefix, kind, name] = source
    return aliases
