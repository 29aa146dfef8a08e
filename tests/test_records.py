"""``Record``: what the records on a solve's path rely on, as typing.NamedTuple gives it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from phi4cli.core.records import Record


class Point(Record):
    """A point."""

    x: int
    y: int = 0
    label: str = "p"

    LIMIT = 10  # a class attribute, not a field

    def moved(self, dx: int) -> Point:
        return self._replace(x=self.x + dx)

    @property
    def far(self) -> bool:
        return abs(self.x) > self.LIMIT


def test_a_record_is_a_named_tuple_with_its_methods_and_defaults():
    point = Point(3)
    assert point == (3, 0, "p") and isinstance(point, tuple)
    assert Point._fields == ("x", "y", "label")
    assert Point._field_defaults == {"y": 0, "label": "p"}
    assert point.moved(20).far and not point.far
    assert repr(point) == "Point(x=3, y=0, label='p')"
    assert Point.__doc__ == "A point." and Point.__module__ == __name__
    assert Point.__annotations__ == {"x": "int", "y": "int", "label": "str"}
    x, y, label = Point(1, 2, "q")
    assert (x, y, label) == (1, 2, "q")
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]


def test_a_field_without_a_default_after_one_with_is_refused():
    with pytest.raises(TypeError, match="follows one with a default"):

        class Bad(Record):  # type: ignore[misc]
            a: int = 1
            b: int


def test_the_records_module_imports_no_typing():
    script = ("import sys\nimport phi4cli.core.records, phi4cli.core.protocol\n"
              "print('typing' in sys.modules)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)  # fmt: skip
    assert result.stdout.strip() == "False"
