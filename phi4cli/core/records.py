"""``Record``: ``typing.NamedTuple`` for the type checker, without importing ``typing`` at run time.

A warm ``phi4 solve`` is mostly interpreter start-up and imports, and ``typing`` alone costs about
2.5 ms of it, the most of any module on that path; the records (settings, paths, events, stats)
were all it was imported for. So the modules a solve imports write ``class Stats(Record): ...``
with annotations and defaults exactly as for ``NamedTuple``: mypy reads ``Record`` as
``NamedTuple`` and checks them as such, and at run time they are built by
``collections.namedtuple`` (fields in order, trailing defaults, methods, properties and class
attributes kept, as ``NamedTuple`` does). Those modules also import typing's names only under
``TYPE_CHECKING`` (mypy treats any constant of that name as true), which
``from __future__ import annotations`` makes possible.
"""

from __future__ import annotations

__all__ = ["Record"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NamedTuple as Record
else:
    from collections import namedtuple

    # What the class body holds that is not for the new class: as typing.NamedTuple.
    _NOT_COPIED = frozenset({"__annotations__", "__module__", "__qualname__", "__dict__",
                             "__weakref__"})  # fmt: skip

    class _RecordMeta(type):
        def __new__(mcls, name, bases, namespace):
            if not bases:  # Record itself
                return super().__new__(mcls, name, bases, namespace)
            annotations = namespace.get("__annotations__", {})
            fields = list(annotations)
            defaults = [namespace[field] for field in fields if field in namespace]
            if any(field not in namespace for field in fields[len(fields) - len(defaults) :]):
                raise TypeError(f"{name}: a field without a default follows one with a default")
            record = namedtuple(name, fields, defaults=defaults, module=namespace["__module__"])
            record.__annotations__ = dict(annotations)
            for key, value in namespace.items():
                if key not in _NOT_COPIED and key not in annotations:
                    setattr(record, key, value)
            return record

    class Record(metaclass=_RecordMeta):
        """Base of the records; subclasses are namedtuple classes."""
