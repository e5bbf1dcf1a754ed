"""The rule for packed rows, written by hand for the tests (docs/watch.md, "Packed rows")."""

from __future__ import annotations


def by_hand(batches: list[list[list[int]]]) -> tuple[list[list[int]], int]:
    """One rank's batches of rows -> each batch's sample ids and the samples split, by the
    rule in docs/watch.md: the -1s that end a row are padding; an id that ends a row and
    begins the next row (the next batch's first row too) is one sample, counted once, however
    many rows it runs over."""
    out, split, last, continued = [], 0, None, False
    for batch in batches:
        ids: list[int] = []
        for row in batch:
            row = list(row)
            while row and row[-1] == -1:
                row.pop()
            merged = bool(row) and last is not None and row[0] == last
            if merged and not continued:
                split += 1
            ids += row[1:] if merged else row
            continued = merged and len(row) == 1
            last = row[-1] if row else None
        out.append(ids)
    return out, split
