"""What the block-kind and the search-strategy registries share: records by name, built-ins that stay, plugins
found through entry points and loaded on first use, the one-line messages, and each record's own settings.

Built-ins cannot be removed; a registry whose built-ins live in a package above it finds them through an entry
point of parnas's own distribution (``builtins``), so no import runs back up the layers. A record may own a
settings class (a frozen dataclass, every field defaulted) that a config fills under ``<section>.<name>.<field>``
(:func:`build_settings`). Imports no torch: configs are checked before it loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any, Generic, TypeVar

from parnas import plugins
from parnas.errors import ConfigError, ParnasError
from parnas.old_keys import old_key_message
from parnas.overrides import from_dict

Record = TypeVar("Record")


class Registry(Generic[Record]):
    """Records of type ``record`` by name. ``what``: how messages call one (``"block kind"``); ``plural``: how
    they call several (``"kinds"``); ``group``: the entry-point group plugins declare; ``how_to_register``: the
    help every "unknown" message ends with; ``error``: the error raised; ``admit(record, records)``: an extra
    check before a record joins (a letter already taken, ...); ``builtins``: an entry-point group each of whose
    entries names a sequence of built-in records, registered in that order the first time the registry is read."""

    def __init__(self, record: type, what: str, plural: str, group: str, how_to_register: str,
                 error: type[ParnasError], admit: Callable[[Any, Mapping[str, Any]], None] | None = None,
                 builtins: str | None = None) -> None:
        self.record, self.what, self.plural, self.group = record, what, plural, group
        self.how_to_register, self.error, self.admit = how_to_register, error, admit
        self._loaded: dict[str, Record] = {}  # read through _records, which registers the built-ins first
        self._builtin: set[str] = set()
        self._type_name = f"{record.__module__}.{record.__qualname__}"
        self._builtins_group = builtins  # None once they are registered (or where there are none)

    @property
    def _records(self) -> dict[str, Record]:
        """The records by name, the built-ins an entry point of ``builtins`` names registered first, on first read."""
        if self._builtins_group is not None:
            self._load_builtins(self._builtins_group)
        return self._loaded

    def _load_builtins(self, group: str) -> None:
        self._builtins_group = None  # once: registering them reads the records
        found = plugins.entry_points(group)
        if not found:
            raise self.error(f"parnas's own {self.plural} are not installed (no entry point in group {group!r}): "
                             "install parnas with pip (pip install -e . in a checkout), not from a path, and remove "
                             "any stale *.egg-info in the working folder (its metadata shadows the installed one)")
        for ep in found.values():
            try:
                records = ep.load()
            except Exception as e:  # an install that lost a file: say which, in one line
                raise self.error(f"parnas's own {self.plural} do not load from {ep.value!r} "
                                 f"({type(e).__name__}: {e}); reinstall parnas") from None
            for record in records:
                self.register(record, builtin=True)

    def register(self, record: Record, *, builtin: bool = False) -> Record:
        """Add ``record``; a name already taken is an error (registering the same record again is not).
        ``builtin``: parnas's own, which :meth:`unregister` keeps."""
        if not isinstance(record, self.record):
            raise self.error(f"register expects a {self._type_name}, got {type(record).__name__}")
        name = record.name  # type: ignore[attr-defined]
        old = self._records.get(name)
        if old == record:
            return record
        if old is not None:
            raise self.error(f"{self.what} {name!r} is already registered"
                             f"{' (built in)' if name in self._builtin else ''}; choose another name")
        if self.admit is not None:
            self.admit(record, self._records)
        self._records[name] = record
        if builtin:
            self._builtin.add(name)
        return record

    def unregister(self, name: str) -> None:
        """Remove a record registered in this process (tests, notebooks); built-ins stay."""
        records = self._records  # the built-ins registered first, so that they are known to stay
        if name in self._builtin:
            raise self.error(f"{self.what} {name!r} is built in and cannot be removed")
        records.pop(name, None)

    def entry_points(self) -> dict[str, metadata.EntryPoint]:
        """Installed plugins by name; reading them imports no plugin."""
        return plugins.entry_points(self.group)

    def names(self) -> tuple[str, ...]:
        """Every known name: built-ins, then registered ones, then plugins not loaded yet. Stable order."""
        return (*self._records, *sorted(set(self.entry_points()) - set(self._records)))

    def is_known(self, name: str) -> bool:
        return name in self._records or name in self.entry_points()

    def loaded(self, name: str) -> Record | None:
        """The record called ``name`` if it is registered already, else None: a plugin not needed yet stays
        unloaded (config checks import neither it nor torch)."""
        return self._records.get(name)

    def records(self) -> Iterator[Record]:
        """The registered records (plugins once loaded), in registry order."""
        return iter(tuple(self._records.values()))

    def load(self, name: str, field: str, target: str) -> Any:
        """What record ``name``'s ``field``, a ``"module:attribute"`` string, names, imported now; a target that
        does not load is this registry's error, in one line."""
        try:
            return plugins.load_target(target)
        except (ImportError, AttributeError) as e:
            raise self.error(f"{self.what} {name!r}: cannot load its {field} {target!r} "
                             f"({type(e).__name__}: {e})") from None

    def unknown_message(self, name: str) -> str:
        return f"unknown {self.what} {name!r}; known {self.plural}: {', '.join(self.names())}; {self.how_to_register}"

    def get(self, name: str) -> Record:
        """The record called ``name``, loading its plugin on first use."""
        if name in self._records:
            return self._records[name]
        ep = self.entry_points().get(name)
        if ep is None:
            raise self.error(self.unknown_message(name))
        try:
            record = ep.load()
        except Exception as e:  # a broken plugin is the user's to fix: say which and why, in one line
            raise self.error(f"{self.what} {name!r}: cannot load entry point {ep.value!r} "
                             f"({type(e).__name__}: {e})") from None
        if not isinstance(record, self.record) or record.name != name:  # type: ignore[attr-defined]
            raise self.error(f"entry point {name!r} ({ep.value}) must name a {self._type_name} called {name!r}, "
                             f"got {record!r:.80}")
        return self.register(record)


def is_settings_class(settings: Any) -> bool:
    """Whether ``settings`` can be a record's settings: a frozen dataclass (its fields defaulted)."""
    return (isinstance(settings, type) and dataclasses.is_dataclass(settings)
            and settings.__dataclass_params__.frozen)  # type: ignore[attr-defined]


def build_settings(settings: type | None, section: Any, prefix: str, name: str, what: str) -> Any:
    """``section`` (a config's ``<prefix><name>`` mapping) built into ``settings``, or None where it holds only
    the defaults (one config, one value). Messages name the key in full (``<prefix><name>.<field>``)."""
    if settings is None:
        for key in section if isinstance(section, Mapping) else ():
            if (message := old_key_message(f"{prefix}{name}.{key}")) is not None:
                raise ConfigError(message)
        raise ConfigError(f"{prefix}{name}: the {name} {what} has no settings")
    if not isinstance(section, Mapping):
        raise ConfigError(f"{prefix}{name} must be a mapping of the {name} {what}'s settings, got {section!r}")
    try:
        made = from_dict(settings, section, f"{prefix}{name}.")
    except ConfigError as e:
        message = str(e)
        raise ConfigError(message if f"{prefix}{name}." in message else f"{prefix}{name}.{message}") from None
    return None if made == settings() else made


class OwnsSettings:
    """A config section (a frozen dataclass) whose records own settings, given as ``<section>.<name>.<field>``: the
    model's kinds, the search's strategies. A subclass names ``OWNERS`` (its :class:`Registry`, whose records have
    ``settings_class()``), ``WHAT`` (how messages call a record) and ``GIVEN`` (its field holding the settings
    given, by name: only those that differ from the defaults, so one config has one value)."""

    OWNERS: Registry[Any]
    WHAT: str
    GIVEN: str

    @classmethod
    def regroup(cls, values: Mapping[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """For :func:`parnas.overrides.from_dict`: ``values`` less its ``<name>`` sections, and those sections built
        into their records' settings, as keyword arguments of the section's class."""
        values = dict(values)
        if cls.GIVEN in values:
            raise ConfigError(f"unknown config key {prefix}{cls.GIVEN}; give a {cls.WHAT}'s settings as "
                              f"{prefix}<{cls.WHAT}>.<setting>")
        fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        named = [key for key in values if key not in fields and cls.OWNERS.is_known(key)]
        built = {name: build_settings(cls.OWNERS.get(name).settings_class(), values.pop(name), prefix, name, cls.WHAT)
                 for name in named}
        built = {name: made for name, made in built.items() if made is not None}
        return values, {cls.GIVEN: built} if built else {}

    def settings_of(self, name: str) -> Any:
        """The settings of record ``name``: those given, else its defaults (None for a record without settings)."""
        given = getattr(self, self.GIVEN).get(name)
        if given is not None:
            return given
        settings = self.OWNERS.get(name).settings_class()
        return None if settings is None else settings()

    def check_given(self, prefix: str) -> None:
        """Each settings given is its record's class (a config built in code may hold anything)."""
        for name, settings in getattr(self, self.GIVEN).items():
            declared = self.OWNERS.get(name).settings_class()
            if declared is None or not isinstance(settings, declared):
                wanted = declared.__name__ if declared is not None else f"none (the {self.WHAT} has none)"
                raise ConfigError(f"{prefix}{name}: settings must be {wanted}")

    def to_dict(self) -> dict[str, Any]:
        """As a config gives it: the section's fields, and each registered record's settings (and any given) as a
        ``<name>`` section."""
        out = dataclasses.asdict(self)  # type: ignore[call-overload]
        del out[self.GIVEN]
        return out | self.sections()

    def sections(self) -> dict[str, Any]:
        """As a config gives them: the settings of every registered record that has some (and any given), by name."""
        owners = [record.name for record in self.OWNERS.records() if record.settings is not None]
        named = dict.fromkeys([*owners, *getattr(self, self.GIVEN)])
        return {name: dataclasses.asdict(self.settings_of(name)) for name in named}
