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
that runs code of its own beside its classes' (a method set on one of its modules, a hook).
"""

from __future__ import annotations

import copy
import functools
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
_HOOKS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks",
)  # fmt: skip


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
    """A digest of everything a capture of ``model`` reads, or None for a model that runs code of its
    own beside its classes' (a method set on a module, a hook)."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    digest.update(_config_state(model.config).encode())
    for path, module in model.named_modules(remove_duplicate=False):
        attributes = vars(module)
        if any(getattr(module, hooks) for hooks in _HOOKS) or any(
            callable(v) and hasattr(type(module), k) for k, v in attributes.items() if not isinstance(v, _MODULES)
        ):
            return None
        plain = sorted((k, v) for k, v in attributes.items() if isinstance(v, _PLAIN))
        functions = sorted(
            (k, _function(v)) for k, v in attributes.items() if callable(v) and not isinstance(v, _MODULES)
        )
        digest.update(f"{path}:{type(module).__qualname__}:{plain!r}:{functions!r}".encode())
        for name, value in attributes.items():  # tensors kept as plain attributes: constants in the graph
            if isinstance(value, torch.Tensor):
                _add_tensor(digest, f"{path}.{name}", value)
    first_name = {}  # tied tensors: one storage under several names
    for name, tensor in _named_tensors(model).items():
        shared = first_name.setdefault((tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)), name)
        _add_tensor(digest, f"{name}={shared}", tensor)
    return digest.hexdigest()


def _config_state(config) -> str:
    """Every attribute of ``config``, its private ones and its sub-configs' included."""
    items = sorted(vars(config).items(), key=lambda item: item[0])
    return repr([(k, _config_state(v) if hasattr(v, "to_json_string") else v) for k, v in items])


def _function(function) -> tuple:
    """A function as a key: a partial by what it binds, anything else by its identity (within this process)."""
    if isinstance(function, functools.partial):
        return _function(function.func), repr(function.args), repr(sorted(function.keywords.items()))
    return getattr(function, "__qualname__", type(function).__qualname__), id(function)


def _add_tensor(digest, name: str, tensor: torch.Tensor) -> None:
    digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:{tensor.device}".encode())
    digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


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
