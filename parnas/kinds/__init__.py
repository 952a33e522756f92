"""Block kinds: the registry (:mod:`parnas.kinds.registry`) and parnas's own kinds
(:mod:`parnas.kinds.builtin`), registered on import. Imports no torch."""

from parnas.kinds import builtin
from parnas.kinds.registry import (
    GROUP,
    HOW_TO_REGISTER,
    BlockKind,
    Check,
    Factory,
    Flops,
    KindError,
    attending,
    check,
    default_settings,
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
    with_settings,
)

__all__ = ["GROUP", "HOW_TO_REGISTER", "BlockKind", "Check", "Factory", "Flops", "KindError", "attending", "builtin",
           "check", "default_settings", "get", "is_known", "letter", "loaded", "make_block", "names", "register",
           "syncing", "unknown_message", "unregister", "with_settings"]
