"""The block-kind registry: every kind of block that may stand at a depth, by name.

``search.candidates``, ``model.blocks``, the architecture JSON, the cost tables and the pictures all go through
:func:`get` / :func:`names`. Imports no torch: configs are checked before it loads, and built-in factories are
``"module:attribute"`` strings imported when :func:`make_block` first runs. Plugins declare entry points in group
``parnas.blocks``, read by name without importing them (docs/reference.md, "Your own kind, from your own package").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from parnas import plugins
from parnas.errors import ConfigError, ParnasError
from parnas.registry import Registry, is_settings_class

if TYPE_CHECKING:
    from torch import nn

ModelConfig = Any  # a parnas.config.ModelConfig, not imported: the config imports this module to check kinds

GROUP = "parnas.blocks"
HOW_TO_REGISTER = (f"a plugin registers one with an entry point in group {GROUP!r} "
                   "(docs/reference.md, 'Block kinds'), or code calls parnas.kinds.register")

Factory = Union[str, Callable[["ModelConfig"], "nn.Module"]]
Flops = Callable[["ModelConfig", int, int], float]  # (cfg, seg_len, batch_size) -> forward FLOPs per token
Check = Callable[[Any, Any], None]  # (the run's Config, the kind's settings) -> None, or raises ConfigError


class KindError(ParnasError):
    """A block kind that cannot be registered, found or built."""


@dataclass(frozen=True)
class BlockKind:
    """One kind of block.

    ``factory(cfg)`` (a callable, or ``"module:attribute"``) returns a fresh ``nn.Module`` whose ``forward(h, mem,
    pos)`` returns a tensor shaped like ``h``. ``uses_memory``: the body passes it the states that entered it
    before as ``mem``. ``letter``: its code in layout strings. ``flops(cfg, seg_len, batch_size)``: forward FLOPs
    per token (else 2 per parameter). ``shared``: all its blocks in a model are one module. ``settings``: a
    frozen dataclass, every field defaulted (``model.<name>.<field>``; read as ``cfg.settings_of(name)``).
    ``check(config, settings)``: raises ConfigError where they do not fit the run's shapes, for every kind a run
    may build. ``reversible``: it can be recomputed in a reversible pair. ``attends``: it mixes tokens by attention
    (summaries and studies count it so). ``capturable``: it reads nothing back to the host, so a step holding it
    can be replayed as CUDA graphs (``train.compile=reduce-overhead`` refuses the others).
    """

    name: str
    factory: Factory
    uses_memory: bool
    letter: str
    flops: Flops | None = None
    shared: bool = False
    source: str = ""  # the paper or code it follows, for the docs
    settings: type | None = None
    check: Check | None = None
    reversible: bool = True
    attends: bool = False
    capturable: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise KindError(f"block kind name {self.name!r} must be a Python identifier, e.g. 'my_mixer'")
        if not (callable(self.factory) or isinstance(self.factory, str) and plugins.split_target(self.factory)):
            raise KindError(f"block kind {self.name!r}: factory must be a callable or a 'module:attribute' "
                            f"string, got {self.factory!r}")
        if not (isinstance(self.letter, str) and len(self.letter) == 1 and self.letter.isascii()
                and self.letter.isalnum()):
            raise KindError(f"block kind {self.name!r}: letter must be one ASCII letter or digit, got {self.letter!r}")
        if not all(isinstance(flag, bool) for flag in (self.uses_memory, self.shared, self.attends, self.capturable)):
            raise KindError(f"block kind {self.name!r}: uses_memory, shared, attends and capturable must be True or "
                            "False")
        if self.flops is not None and not callable(self.flops):
            raise KindError(f"block kind {self.name!r}: flops must be a callable (cfg, seg_len, batch_size) -> float")
        if self.settings is not None and not is_settings_class(self.settings):
            raise KindError(f"block kind {self.name!r}: settings must be a frozen dataclass, got {self.settings!r}")
        if self.check is not None and not callable(self.check):
            raise KindError(f"block kind {self.name!r}: check must be a callable (config, settings) -> None")

    def settings_class(self) -> type | None:
        """The class of this kind's settings (None: it has none), as a strategy's is read."""
        return self.settings

    def build(self, cfg: ModelConfig) -> nn.Module:
        """A fresh block; ``kind`` and ``uses_memory`` are set on it from this record."""
        from torch import nn

        factory = KINDS.load(self.name, "factory", self.factory) if isinstance(self.factory, str) else self.factory
        block = factory(cfg)
        if not isinstance(block, nn.Module):
            raise KindError(f"block kind {self.name!r}: its factory returned {type(block).__name__}, not an nn.Module")
        block.kind, block.uses_memory = self.name, self.uses_memory
        return block


# --- the registry -------------------------------------------------------------------------------

def _letter_free(kind: BlockKind, registered: Mapping[str, BlockKind]) -> None:
    taken = {k.letter: k.name for k in registered.values()}
    if kind.letter in taken:
        raise KindError(f"block kind {kind.name!r}: letter {kind.letter!r} is taken by {taken[kind.letter]!r}; "
                        f"letters in use: {''.join(sorted(taken))}")


KINDS: Registry[BlockKind] = Registry(BlockKind, "block kind", "kinds", GROUP, HOW_TO_REGISTER, KindError,
                                      admit=_letter_free)
register, unregister, names, is_known = KINDS.register, KINDS.unregister, KINDS.names, KINDS.is_known
loaded, unknown_message, get = KINDS.loaded, KINDS.unknown_message, KINDS.get


def check(kinds: Sequence[str], key: str) -> tuple[str, ...]:
    """Config check: known, distinct, at least one (raises ConfigError naming ``key``)."""
    for name in kinds:
        if not isinstance(name, str) or not is_known(name):
            raise ConfigError(f"{key}: {unknown_message(name)}")
    if not kinds or len(set(kinds)) != len(kinds):
        raise ConfigError(f"{key} must be distinct and non-empty, got {list(kinds)}")
    return tuple(kinds)


def attending(layout: Sequence[str]) -> int:
    """How many blocks of ``layout`` attend (:attr:`BlockKind.attends`); a name no kind has does not."""
    return sum(1 for name in layout if is_known(name) and get(name).attends)


def syncing(kinds: Sequence[str]) -> list[str]:
    """The kinds of ``kinds`` (each once, in order) that are not :attr:`BlockKind.capturable`: a step holding them
    cannot be replayed as CUDA graphs."""
    return [name for name in dict.fromkeys(kinds) if not get(name).capturable]


def letter(name: str) -> str:
    """The one-letter code of a kind ('?' for a name no kind has)."""
    try:
        return get(name).letter
    except KindError:
        return "?"


def make_block(name: str, cfg: ModelConfig) -> nn.Module:
    """A fresh block of kind ``name`` built from ``cfg`` alone (what the cost tables time)."""
    return get(name).build(cfg)
