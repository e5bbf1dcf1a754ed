"""Tokens and sources, pure (no torch): what each data-parallel group trained on in tokens, and
the mixture of sources it received against the weights it was configured with (watch's
`tokens=`, `sources=`, `weights=`; docs/tokens.md).

The mixture's rule: a run that draws each sample's source at random with probabilities p_i
(datasets' interleave_datasets, a WeightedRandomSampler, a weighted sampler of one's own)
delivers, of n samples, k_i from source i, binomial (n, p_i). The verdict
`mixture-matches-weights` fails only where some k_i lies outside n p_i +- (Z sd_i + 1), with
sd_i = sqrt(n p_i (1 - p_i)) and Z = MIXTURE_Z: a bound that widens with the count, so that a
short window or a small epoch never cries wolf (for one source, a false alarm comes about once
in 1.7 million checks: the normal tail beyond 5 sd, the +1 covering the binomial's
discreteness), while a mixture off by a few points is caught once n is in the thousands. A
source the weights do not name (weight 0) fails at its first sample."""

from __future__ import annotations

import math
from typing import Optional, Union

MIXTURE_Z = 5.0
MIXTURE_VERDICT = "mixture-matches-weights"
SKEW_VERDICT = "token-skew-within-limit"


def normalized(weights: Union[list, tuple, dict]) -> dict[str, float]:
    """The weights as {source name: probability}: a list's positions are the sources 0, 1, ...
    (their names "0", "1", ...), a dict's keys their names; divided by their sum."""
    items = (weights.items() if isinstance(weights, dict)
             else enumerate(weights))
    pairs = [(str(k), float(w)) for k, w in items]
    total = sum(w for _, w in pairs)
    return {k: w / total for k, w in pairs}


def judge_mixture(counts: dict[str, int], weights: dict[str, float],
                  z: float = MIXTURE_Z) -> dict:
    """Each source's realized count against its weight (`weights` normalized): its expected
    count, the band n p +- (z sd + 1) and whether the count is inside; `ok` where all are."""
    n = sum(counts.values())
    rows = []
    for name in list(weights) + [s for s in counts if s not in weights]:
        p = weights.get(name, 0.0)
        k = counts.get(name, 0)
        expected = n * p
        if p <= 0.0:
            low = high = 0.0
        else:
            half = z * math.sqrt(n * p * (1 - p)) + 1
            low, high = max(0.0, expected - half), min(float(n), expected + half)
        rows.append({"source": name, "weight": p, "samples": k,
                     "share": k / n if n else 0.0, "expected": expected,
                     "low": low, "high": high, "ok": low <= k <= high})
    return {"samples": n, "sources": rows, "ok": all(r["ok"] for r in rows)}


def mixture_verdict(check: dict, epoch: int) -> dict:
    """The verdict from judge_mixture, its detail naming each source outside its band."""
    bad = [r for r in check["sources"] if not r["ok"]]
    detail = "; ".join(
        (f"source {r['source']!r}: {r['samples']:,} of {check['samples']:,} samples "
         f"({r['share']:.1%}), weight {r['weight']:.1%}: outside "
         f"{math.ceil(r['low']):,}-{math.floor(r['high']):,}")
        if r["weight"] > 0 else
        f"source {r['source']!r}: {r['samples']:,} samples, but the weights do not name it"
        for r in bad)
    named = [r["source"] for r in check["sources"] if r["weight"] > 0]
    got = [r["source"] for r in check["sources"] if r["samples"]]
    if bad and got and not set(named) & set(got):
        # no source the batches hold is one the weights name: a mismatch of names, not a mix
        kind = ("indices" if all(s.lstrip("-").isdigit() for s in got) else "names")
        detail = (f"the batches' sources ({kind} {', '.join(map(repr, got[:6]))}) are none of "
                  f"the weights' ({', '.join(map(repr, named[:6]))}): give weights as a list "
                  "in the sources' index order, or a dict keyed by the names the batches hold"
                  if kind == "indices" or not all(s.isdigit() for s in named) else
                  f"the batches' sources ({kind} {', '.join(map(repr, got[:6]))}) are none of "
                  f"the weights' (indices {', '.join(map(repr, named[:6]))}): give weights as "
                  "a dict keyed by the names the batches hold")
    elif bad:
        detail += (f" (the band: n p +- ({MIXTURE_Z:g} sd + 1), binomial; the run does not draw "
                   "its sources with the weights given)")
    return {"verdict": MIXTURE_VERDICT, "epoch": epoch, "ok": not bad, "detail": detail}


def token_summary(parts: list[dict]) -> dict:
    """Every data-parallel group's tokens (`parts`: one a group, by group; each {"tokens",
    "slots", "supervised", "sources": {name: [samples, tokens]}}, a figure None where it was
    not measured) -> the report's `tokens`: per group, the total, the skew (the most a group
    received over the mean), the padding's share of the slots, the supervised tokens."""
    counted = [int(p["tokens"]) for p in parts]
    total = sum(counted)
    mean = total / len(counted) if counted else 0
    out: dict = {"per_group": counted, "total": total,
                 "skew": (max(counted) / mean) if mean else None}
    if any(p.get("after_restart") for p in parts):
        # a resumed epoch whose sums before the stop are not known here (docs/tokens.md)
        out["after_restart"] = True
    slots = [int(p["slots"]) for p in parts if p.get("slots") is not None]
    room = sum(slots)
    if len(slots) == len(parts) and room > 0:
        out["padding_share"] = 1 - total / room
    supervised = [int(p["supervised"]) for p in parts if p.get("supervised") is not None]
    if len(supervised) == len(parts):
        out["supervised_per_group"] = supervised
        out["supervised"] = sum(supervised)
    return out


def source_totals(parts: list[dict]) -> dict[str, list[int]]:
    """{source: [samples, tokens]} over the groups."""
    totals: dict[str, list[int]] = {}
    for part in parts:
        for name, (samples, tokens) in (part.get("sources") or {}).items():
            row = totals.setdefault(name, [0, 0])
            row[0] += samples
            row[1] += tokens
    return totals


def skew_verdict(summary: dict, limit: float, epoch: int) -> dict:
    """`max_token_skew=`: the most tokens a group received over the mean, within the limit."""
    skew = summary.get("skew")
    ok = skew is None or skew <= limit
    detail = "" if ok else (f"the groups' tokens {summary['per_group']} are {skew:.3f}x the mean "
                            f"at the most, over the limit {limit:g}x")
    return {"verdict": SKEW_VERDICT, "epoch": epoch, "ok": ok, "detail": detail}


def tokens_words(entry: dict) -> str:
    """', 12,288 tokens (skew 1.02x, padding 18%)' and ', sources web 70.4% / code 29.6%' for
    an entry's line; '' where neither was measured."""
    words = ""
    measured = entry.get("tokens")
    if measured:
        bits = [f"skew {measured['skew']:.2f}x"] if measured.get("skew") else []
        if measured.get("padding_share") is not None:
            bits.append(f"padding {measured['padding_share']:.0%}")
        if measured.get("supervised") is not None:
            bits.append(f"{measured['supervised']:,} supervised")
        after = " after the restart" if measured.get("after_restart") else ""
        words += (f", {measured['total']:,} tokens{after}"
                  + (f" ({', '.join(bits)})" if bits else ""))
    sources = entry.get("sources")
    if sources:
        # over every sample received: where a sampler's padding or fill repeated some, more
        # than the distinct samples the line counts
        over = sum(row["samples"] for row in sources.values())
        if any(row.get("after_restart") for row in sources.values()):
            said = f" after the restart (of its {over:,} received)"
        else:
            said = (f" (of all {over:,} received, repeats too)"
                    if entry.get("unique") is not None and over != entry["unique"] else "")
        words += f", sources{said} " + " / ".join(f"{name} {row['share']:.1%}"
                                                  for name, row in sources.items())
    return words


def judge_tokens(parts: list[dict], weights: Optional[dict], limit: Optional[float],
                 epoch: int) -> tuple[dict, list[dict]]:
    """The entry's `tokens`, `sources` and `mixture`, and the verdicts they give (the mixture
    where `weights` were given, the skew where `limit` was), from each group's part."""
    fields: dict = {}
    verdicts = []
    if parts and parts[0].get("tokens") is not None and any(
            p.get("slots") is not None or p.get("tokens") for p in parts):
        fields["tokens"] = token_summary(parts)
        if limit is not None:
            verdicts.append(skew_verdict(fields["tokens"], limit, epoch))
    if parts and parts[0].get("sources") is not None:
        totals = source_totals(parts)
        samples = sum(s for s, _ in totals.values())
        tokens = sum(t for _, t in totals.values())
        after = any(p.get("after_restart") for p in parts)
        fields["sources"] = {name: {"samples": s, "tokens": t,
                                    "share": s / samples if samples else 0.0,
                                    "token_share": t / tokens if tokens else None,
                                    "weight": (weights or {}).get(name),
                                    **({"after_restart": True} if after else {})}
                             for name, (s, t) in sorted(totals.items())}
        if weights is not None:
            check = judge_mixture({name: s for name, (s, _) in totals.items()}, weights)
            fields["mixture"] = check
            verdicts.append(mixture_verdict(check, epoch))
    return fields, verdicts
