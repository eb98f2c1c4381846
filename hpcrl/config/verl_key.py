"""One entry of verl's key table (:data:`hpcrl.config.verl_keys.VERL_KEYS`), in a module of its own so that the table's
parts (``verl_keys.py``, ``verl_reward.py``) can be written in several files."""
from __future__ import annotations

from typing import NamedTuple, Optional


class VerlKey(NamedTuple):
    """How hpcrl reads one of verl's config keys (an entry of :data:`VERL_KEYS`)."""

    target: Optional[str]
    """hpcrl's dotted key that takes the value (with a key ending in ``.*``: the same rest of the key
    under this prefix), or None: the key has no meaning here."""
    note: str = ""
    """Said once when the key is used: how the value is read, or what hpcrl does instead."""
    refuse: bool = False
    """The key cannot be honoured: a value other than false/null/0/empty is refused with ``note`` as the
    reason (what hpcrl offers instead), before anything is submitted."""
    keys: tuple = ()
    """A ``.*`` entry: the keys verl has under its prefix (a key below one of them is that key's value); another
    is refused as unknown, with the nearest. Empty: every key under the prefix is taken."""
