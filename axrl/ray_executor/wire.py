"""What really crosses the driver: every `ray.get`, `ray.put`, actor call and actor start made in
the driver process, measured at the size Ray serialises.

`wire_bytes(obj)` pickles `obj` the way Ray does (cloudpickle, protocol 5, array buffers out of
band) and counts the stream plus the out-of-band buffers; an object reference or actor handle
inside counts as its id (Ray sends the id and its owner's address, not the object). `DriverWire`
wraps `ray.get`, `ray.put`, `ActorMethod._remote` (a call's arguments), `ActorClass._remote` (an
actor's constructor arguments: settings, config) and `RemoteFunction._remote` in this process
while a run is open, and adds what each moved to the run's `DataPlane` (`driver`, by category
"call <method>", "result <method>", "start <class>", "put", "get"). A result is counted once per
object: a reference resolved again (a retried read, the same handle twice) adds nothing.

Not measured: Ray's own control traffic (task specs beyond the arguments, GCS and raylet
messages, the actor classes' code exported once), and what the actors send each other.
"""

from __future__ import annotations

import functools
import io
import threading
from typing import Any


@functools.cache
def _pickler() -> type:
    """Ray's pickling of a value, with references and actor handles reduced to their ids."""
    from ray import ObjectRef, cloudpickle
    from ray.actor import ActorHandle

    class Pickler(cloudpickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, ObjectRef):
                return obj.binary()
            if isinstance(obj, ActorHandle):
                return obj._actor_id.binary()
            return None

    return Pickler


def wire_bytes(obj: Any) -> int:
    """Serialised bytes of `obj` as Ray sends it (pickle protocol 5, buffers out of band)."""
    buffers: list[int] = []

    def out_of_band(buf: Any) -> bool:
        buffers.append(buf.raw().nbytes)
        return False

    stream = io.BytesIO()
    _pickler()(stream, protocol=5, buffer_callback=out_of_band).dump(obj)
    return stream.tell() + sum(buffers)


class DriverWire:
    """While open, counts into `plane` what this process sends and receives through Ray. One wire
    is open at a time (a run's executor opens it and closes it); opening one closes the last."""

    _open: "DriverWire | None" = None
    _lock = threading.Lock()

    def __init__(self, plane: Any) -> None:
        self.plane = plane
        # References whose value was counted already, and reference → the actor method whose
        # result it is: the latest `REMEMBER` of each (a long run's heartbeats would grow them).
        self._seen: dict[bytes, None] = {}
        self._method: dict[bytes, str] = {}
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def open(self) -> "DriverWire":
        import ray
        import ray.actor
        import ray.remote_function

        with DriverWire._lock:
            last = DriverWire._open
        if last is not None:
            last.close()
        with DriverWire._lock:
            DriverWire._open = self
        wire = self

        def patch(owner: Any, name: str, make: Any) -> None:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, make(original))

        def get(original):
            def counted_get(object_refs, *args, **kwargs):
                value = original(object_refs, *args, **kwargs)
                wire._received(object_refs, value)
                return value
            return counted_get

        def put(original):
            def counted_put(value, *args, **kwargs):
                ref = original(value, *args, **kwargs)
                if wire._outermost():
                    wire._count("put", value)
                    wire._remember(wire._seen, ref.binary(), None)
                return ref
            return counted_put

        def method_call(original):
            def counted_call(method, args=None, kwargs=None, *rest, **options):
                name = getattr(method, "_method_name", "?")
                if wire._outermost():
                    wire._count(f"call {name}", (list(args or ()), dict(kwargs or {})))
                out = original(method, args, kwargs, *rest, **options)
                for ref in out if isinstance(out, list) else [out]:
                    if hasattr(ref, "binary"):
                        wire._remember(wire._method, ref.binary(), name)
                return out
            return counted_call

        def start(kind):
            def wrap(original):
                def counted_start(cls, args=None, kwargs=None, *rest, **options):
                    if wire._outermost():
                        name = getattr(cls, "__name__", None) or getattr(
                            getattr(cls, "__ray_metadata__", None), "class_name", kind)
                        wire._count(f"start {name.rsplit('.', 1)[-1]}", (list(args or ()), dict(kwargs or {})))
                    return original(cls, args, kwargs, *rest, **options)
                return counted_start
            return wrap

        patch(ray, "get", get)
        patch(ray, "put", put)
        patch(ray.actor.ActorMethod, "_remote", method_call)
        patch(ray.actor.ActorClass, "_remote", start("actor"))
        patch(ray.remote_function.RemoteFunction, "_remote", start("task"))
        return self

    def close(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        with DriverWire._lock:
            if DriverWire._open is self:
                DriverWire._open = None

    REMEMBER = 1 << 16

    def _remember(self, where: dict[bytes, Any], key: bytes, value: Any) -> None:
        with DriverWire._lock:
            where[key] = value
            if len(where) > self.REMEMBER:
                del where[next(iter(where))]

    def _outermost(self) -> bool:
        """Not inside another counted call (Ray's own calls made on behalf of one)."""
        return not getattr(self._local, "busy", False)

    def _count(self, category: str, value: Any) -> None:
        self._local.busy = True
        try:
            n = wire_bytes(value)
        finally:
            self._local.busy = False
        self.plane.crossed(category, n)

    def _received(self, refs: Any, value: Any) -> None:
        pairs = zip(refs, value) if isinstance(refs, list) else [(refs, value)]
        for ref, v in pairs:
            key = ref.binary() if hasattr(ref, "binary") else None
            if key is not None:
                with DriverWire._lock:
                    if key in self._seen:
                        continue
                    method = self._method.pop(key, None)
                self._remember(self._seen, key, None)
            else:
                method = None
            self._count(f"result {method}" if method else "get", v)
