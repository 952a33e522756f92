"""Block kinds: the registry (:mod:`parnas.kinds.registry`) and parnas's own kinds
(:mod:`parnas.kinds.builtin`), registered on import. Imports no torch."""

from parnas.kinds import builtin
from parnas.kinds.registry import (
    HOW_TO_REGISTER,
    BlockKind,
    KindError,
    attending,
    check,
    get,
    is_known,
    letter,
    loaded,
    make_block,
    names,
    register,
    syncing,
    unknown_message,
    unregister,
)

__all__ = ["HOW_TO_REGISTER", "BlockKind", "KindError", "attending", "builtin", "check", "get", "is_known", "letter",
           "loaded", "make_block", "names", "register", "syncing", "unknown_message", "unregister"]
