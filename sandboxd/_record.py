"""Small immutable record classes, without importing ``dataclasses``.

``dataclasses`` imports ``inspect``, which imports ``ast``, ``dis``, ``enum``,
``tokenize`` and ``re``: about 28 ms on the CI machine, more than a whole
sandbox launch, on the path every ``sandboxd run`` takes (the issue asks the
one-shot path to import only what it needs). The policy and plan types need
little of it: keyword or positional construction with defaults, a
``__post_init__`` hook, ``repr``, type-aware equality and hashing, frozen
attributes and ``replace``. That is all this provides.

``Choice`` is the same for ``enum``: a closed set of names (a policy's modes), each member a
``str`` so that it compares, hashes, prints and encodes (JSON, protobuf) as its name, and
``parse`` is the one way from a caller's text to a member.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    # Only the type checker reads these: ``typing`` stays off the ``sandboxd run`` path.
    from typing import Any, Callable, ClassVar, Self, TypeVar, dataclass_transform

    T = TypeVar("T")


class _Factory:
    """A default made fresh for each instance (like ``field(default_factory=...)``)."""

    __slots__ = ("make",)

    def __init__(self, make: "Callable[[], Any]") -> None:
        self.make = make


if TYPE_CHECKING:
    def Factory(make: Callable[[], T]) -> T:
        """To the type checker a ``Factory(make)`` default is a value of ``make``'s type."""
        ...
else:
    Factory = _Factory

    def dataclass_transform(**_: object) -> object:
        """A no-op at run time: the decorator only tells type checkers how Records are built."""
        return lambda cls: cls


# Type checkers build each subclass's ``__init__``, fields, equality and immutability from
# its annotations, as they do for a frozen dataclass (``frozen=False`` in the class line
# makes a mutable one); Record itself implements the same at run time.
@dataclass_transform(frozen_default=True)
class Record:
    """Base class: annotated class attributes become fields, in order; a value is their default."""

    _fields: tuple[str, ...] = ()
    _defaults: dict[str, object] = {}
    _frozen: bool = True

    def __init_subclass__(cls, frozen: bool = True, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        fields = list(cls._fields)
        defaults = dict(cls._defaults)
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            if name.startswith("_") or str(annotation).startswith("ClassVar"):
                continue
            if name not in fields:
                fields.append(name)
            if name in cls.__dict__:
                defaults[name] = cls.__dict__[name]
                delattr(cls, name)
        cls._fields, cls._defaults, cls._frozen = tuple(fields), defaults, frozen

    def __init__(self, *args: object, **kwargs: object) -> None:
        if len(args) > len(self._fields):
            raise TypeError(f"{type(self).__name__} takes at most {len(self._fields)} positional arguments")
        values = dict(zip(self._fields, args, strict=False))   # fields not given come after
        for name, value in kwargs.items():
            if name not in self._fields:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__} got {name!r} twice")
            values[name] = value
        for name in self._fields:
            if name not in values:
                if name not in self._defaults:
                    raise TypeError(f"{type(self).__name__} needs {name!r}")
                default = self._defaults[name]
                values[name] = default.make() if isinstance(default, _Factory) else default
            object.__setattr__(self, name, values[name])
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __setattr__(self, name: str, value: object) -> None:
        if self._frozen:
            raise AttributeError(f"{type(self).__name__} is immutable: use .replace({name}=...)")
        object.__setattr__(self, name, value)

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Record)  # the type check above; this narrows for the type checker
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self._values()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields)
        return f"{type(self).__name__}({inner})"

    def replace(self, **changes: object) -> "Self":
        values = {name: getattr(self, name) for name in self._fields}
        values.update(changes)
        return type(self)(**values)

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self._fields}


class Choice(str):
    """One of a closed set of names: an enum without importing ``enum`` (which ``re`` and
    ``dataclasses`` pull in, and ``sandboxd run`` does without). A subclass declares its members as
    ``ClassVar``s of its own type and makes them once with ``define``; ``parse`` returns the member
    a text names, or raises ValueError listing them. Members are ``str``: equal to their name."""

    __slots__ = ()
    _members: "ClassVar[dict[str, Any]]" = {}

    @classmethod
    def define(cls, **members: str) -> None:
        """Make the members: ``define(ISOLATED="isolated", HOST="host")``, in their order."""
        made = {}
        for attribute, text in members.items():
            member = str.__new__(cls, text)
            setattr(cls, attribute, member)
            made[text] = member
        cls._members = made

    @classmethod
    def parse(cls, text: object) -> "Self":
        """The member named ``text`` (a member gives itself), or ValueError naming the choices."""
        member: "Self | None" = cls._members.get(text) if isinstance(text, str) else None
        if member is None:
            raise ValueError(f"{text!r} is not one of {', '.join(cls._members)}")
        return member

    @classmethod
    def all(cls) -> "tuple[Self, ...]":
        return tuple(cls._members.values())
