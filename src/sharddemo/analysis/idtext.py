"""Lists of ids as short text: the one formatter of the report's lines and the findings.

Pure Python (no numpy), so that the renderer can import it without the rest of the analysis.
"""

from __future__ import annotations

from typing import Optional, Sequence

# What follows the ids shown where there are more: `{rest}` is filled with how many are not
# shown, `{total}` with how many there are.
MORE_DOTS = ", ..."
MORE_REST = ", ... {rest} more"


def ids_text(ids: Sequence[int], limit: int = 12, *, total: Optional[int] = None,
             sep: str = ", ", more: str = MORE_DOTS, brackets: bool = False,
             empty: Optional[str] = None) -> str:
    """Return the first `limit` ids as text, marked where there are more.

    `total`: how many ids there are, where `ids` was cut short already (default: len(ids)).
    `more`: what follows the ids shown when there are more than `limit` (MORE_DOTS,
    MORE_REST, or a format of `{rest}` and `{total}`). `brackets`: in `[...]`. `empty`: the
    text for no ids at all (default: the empty list, `""` or `"[]"`).

    >>> ids_text([3, 7, 9, 12], 2)
    '3, 7, ...'
    >>> ids_text([3, 7, 9, 12], 2, more=MORE_REST)
    '3, 7, ... 2 more'
    >>> ids_text([3, 7, 9, 12], 2, sep=" ", more=" ... ({total})")
    '3 7 ... (4)'
    >>> ids_text([3, 7], 2, total=5, brackets=True)
    '[3, 7, ...]'
    """
    if not ids and empty is not None:
        return empty
    count = len(ids) if total is None else total
    text = sep.join(str(i) for i in ids[:limit])
    if count > limit:
        text += more.format(rest=count - limit, total=count)
    return f"[{text}]" if brackets else text
