"""Integer handles naming moekit's objects inside compiled graphs (custom_ops' opaque ops).

A custom op cannot take a module or a MoEWeights as an argument, so a compiled graph names one by
an integer: the object's id(), registered here (weakly: a deleted layer leaves nothing behind)
so that the op finds the object again when it runs. This module stays free of torch._dynamo so
that moekit's own modules can register at construction without making `import moekit` pay for
the compiler (custom_ops is imported only while compiling).

moekit's modules (MoELayer, MoekitExperts) hold their handle as an int attribute from the start
(HandleOwner): the compiler reads it like any int attribute of a module, so by default each
layer gets its own graph (the value is specialized and guarded), and with
torch._dynamo.config.allow_unspec_int_on_nn_module = True it becomes an input of one graph that
every layer shares (regional compilation: README). Other objects (MoEWeights, transformers' own
experts modules) get theirs at trace time from custom_ops.handle_of.
"""

from __future__ import annotations

import weakref

_OBJECTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
HANDLE_ATTR = "_moekit_handle"


def register(obj) -> int:
    """Registers obj under its id() and returns that handle."""
    handle = id(obj)
    _OBJECTS[handle] = obj
    return handle


def lookup(handle: int):
    """The object registered under `handle`; a clear error if it has been deleted."""
    obj = _OBJECTS.get(handle)
    if obj is None:
        raise RuntimeError(
            f"moekit: the layer this compiled graph was traced with (handle {handle}) no longer "
            "exists: it was deleted (compile the model again), or built inside the compiled "
            "function (build moekit layers and weights outside it), or the graph is a torch.export "
            "program loaded in another process (moekit's ops name their layer by a handle of the "
            "process that traced it: an exported program runs only there, while its layer lives)"
        )
    return obj


class HandleOwner:
    """Mixin of moekit's modules: the handle as an int attribute, set at construction and again on
    every copy (copy.copy, copy.deepcopy, pickle: each restores a module through __setstate__;
    nn.DataParallel's replicas, which copy __dict__ directly), so that a copy never carries its
    original's handle (its compiled graph would run the original's weights)."""

    def _take_handle(self) -> None:
        self.__dict__[HANDLE_ATTR] = register(self)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._take_handle()

    def _replicate_for_data_parallel(self):
        replica = super()._replicate_for_data_parallel()
        replica._take_handle()
        return replica
