"""Samples named by keys: numbered 0..N-1 for the analysis, named by key in the report.

A trace whose records hold keys (rank.keys: each rank's ids became its keys on the main
process) is numbered before the analysis (number_keys) and its report named after it
(name_report), so that every count, reason and verdict is the one integer ids get.

- With the set of keys known (a file of keys, one per line: `--keys FILE`), key k of the
  file is id k and N is the file's length; a missing sample is named. A key the loader
  delivered that the file lacks is numbered from N on: outside the dataset.
- Without it, the keys seen (in any epoch) are numbered in sorted order and N is the
  dataset's size (given, or the dataset's length) or, without one, the keys seen. Missing
  samples are then counted (N minus the keys seen) but not named: nobody says which keys
  they are.

Three ranks saw the keys "b", "a" / "c" / "a" and N = 4 is given: a -> 0, b -> 1, c -> 2;
the analysis finds id 0 twice and id 3 missing; the report says "a" twice and 1 missing,
unnamed.
"""

from __future__ import annotations

from typing import Optional


def records_of(trace: dict) -> list[dict]:
    return [record for mode in trace.get("modes", {}).values() for record in mode.get("epochs", [])]


def holds_keys(trace: dict) -> bool:
    return any(record.get("ids_are_keys") or record.get("key_slots")
               for record in records_of(trace))


def source_keys_of(trace: dict) -> Optional[tuple[list[str], str]]:
    """Return the dataset's own keys the main rank read, with where they come from.

    An audit reads them from a datasets.Dataset's column of keys; None where it read none. One
    audited loader only: a framework's loaders each have their own dataset."""
    modes = list(trace.get("modes", {}).values())
    if len(modes) == 1 and modes[0].get("keys_known") is not None:
        return modes[0]["keys_known"], modes[0].get("keys_from", "the dataset")
    return None


def _number_counted(trace: dict, records: list[dict], known: Optional[list[str]]) -> dict:
    """Name the ids of counted records (the count path over keys: rank.keys.KeyIndex).

    Their ids are already the keys' positions in the known set; only the keys outside it and the
    collisions need names."""
    n = records[0]["key_slots"]["n"]
    if known is None or len(known) != n:
        raise ValueError("the count path numbered keys by a set the parent does not hold")
    outside: dict[int, str] = {}
    collisions, count = [], 0
    pairs = {tuple(p) for p in records[0]["key_slots"]["known_collisions"]}
    for record in records:
        events = record.pop("key_slots")
        outside.update({int(i): k for i, k in events["outside"].items()})
        count += events["collision_count"]
        collisions += [{"key": key, "with": known[slot], "epoch": record["epoch"]}
                       for key, slot in events["collisions"]]
    trace["dataset_size"] = n
    for mode in trace.get("modes", {}).values():
        if "sizes" in mode:
            mode["sizes"]["dataset_size"] = n
    return {"names": list(known), "known": True, "seen": None, "dataset_size": n,
            "outside": outside, "hashed": True,
            "collisions": {"known": [[known[a], known[b]] for a, b in sorted(pairs)],
                           "delivered": collisions, "delivered_count": count}}


def number_keys(trace: dict, known: Optional[list[str]] = None,
                size: Optional[int] = None) -> Optional[dict]:
    """Renumber every key of the trace's records 0..N-1, in place, and set N.

    Returns the names ({"names": key of each id, "known": whether the set of keys was known, "seen":
    how many distinct keys the loader delivered}), or None where no record holds keys. `size`: the
    dataset's size where given (--dataset-size), else the dataset's own length the ranks read (the
    trace's)."""
    counted = [r for r in records_of(trace) if r.get("key_slots")]
    if counted:
        return _number_counted(trace, counted, known)
    records = [r for r in records_of(trace) if r.get("ids_are_keys")]
    if not records:
        return None
    seen: set[str] = set()
    for record in records:
        for rank in record["ranks"]:
            for batch in rank["batches"]:
                seen.update(batch)
    if known is not None:
        names = list(known)
        index = {key: k for k, key in enumerate(names)}
        extra = sorted(seen - index.keys())
        n = len(names)
    else:
        names = sorted(seen)
        index = {key: k for k, key in enumerate(names)}
        extra = []
        n = max(size if size is not None else 0, len(names))
    for key in extra:  # delivered, not in the known set: outside the dataset
        index[key] = len(names)
        names.append(key)
    for record in records:
        for rank in record["ranks"]:
            rank["batches"] = [[index[key] for key in batch] for batch in rank["batches"]]
        if record.get("gathered_for_metrics") is not None:
            record["gathered_for_metrics"] = [index[k] for k in record["gathered_for_metrics"]]
        record.pop("ids_are_keys", None)
    trace["dataset_size"] = n
    for mode in trace.get("modes", {}).values():
        if "sizes" in mode:
            mode["sizes"]["dataset_size"] = n
    return {"names": names, "known": known is not None, "seen": len(seen), "dataset_size": n}


def name_epoch(epoch: dict, names: list[str], outside: Optional[dict] = None) -> dict:
    """Replace every sample id in an analysed epoch by the sample's key, in place.

    Done before the verdicts and the conclusion read it. Missing ids without a key (the set of keys
    not known) are left out of the `missing` list; missing_count still counts them. `outside`: the
    keys of ids outside the set, where the count path gave them ids of their own."""
    outside = outside or {}

    def name(i):
        return names[i] if 0 <= i < len(names) else outside.get(i, i)

    for rank in epoch.get("ranks", []):
        for part in ("batches", "first_batches", "last_batches"):
            if part in rank:
                rank[part] = [[name(i) for i in batch] for batch in rank[part]]
    epoch["missing"] = [names[i] for i in epoch.get("missing", []) if i < len(names)]
    epoch["out_of_range"] = [name(i) for i in epoch.get("out_of_range", [])]
    for dup in epoch.get("duplicates", []):
        dup["id"] = name(dup["id"])
    for part in ("gathered", "gathered_for_metrics"):
        if epoch.get(part) is not None:
            epoch[part] = [name(i) for i in epoch[part]]
    return epoch


def name_windows(accum: dict, names: list[str]) -> dict:
    """The gradient-accumulation windows' ids (analysis.accumulation) replaced by keys."""
    for window in accum.get("windows", []) or []:
        window["ranks"] = [[names[i] if 0 <= i < len(names) else i for i in ids]
                           for ids in window["ranks"]]
    return accum


def keys_section(keys: dict, field: Optional[str]) -> dict:
    """The report's `keys` object (docs/report.md)."""
    out = {"field": field, "known": keys["known"], "seen": keys["seen"],
           "dataset_size": keys["dataset_size"], "missing_named": keys["known"],
           "from": keys.get("from"), "hashed": bool(keys.get("hashed"))}
    if keys.get("hashed"):
        out["collisions"] = keys["collisions"]
    return out
