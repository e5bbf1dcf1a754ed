"""The watch's tokens and sources: tokens per data-parallel group (each group once on a mesh,
never x tp), their skew and padding; the realized mixture of sources against the weights, with a
band that widens with the count.

Real ranks: torchrun, 4 gloo processes (tests/scripts/tokens_loop.py logs what each rank's loop
received: each sample's tokens from its mask, its supervised tokens, its source). Expected
values from those logs, from datasets' interleave_datasets itself, and from numpy's multinomial
for the band's rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from support.launch import sharddemo, torchrun

LOOP = Path(__file__).resolve().parents[1] / "scripts" / "tokens_loop.py"
SCHEMA = json.loads((LOOP.parents[2] / "docs" / "watch.schema.json").read_text())
T = 16  # (tokens_loop's row length)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The loop launched once: (every rank's log, the report's entries, the output folder)."""
    out = tmp_path_factory.mktemp("tokens")
    torchrun([LOOP, out], nproc=4, timeout=240)
    logs = [json.loads((out / f"log{r}.json").read_text()) for r in range(4)]
    entries = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    for entry in entries:
        jsonschema.validate(entry, SCHEMA)
    return logs, entries, out


def rows(logs, case, epoch, ranks=None):
    return [row for log in logs if ranks is None or log["rank"] in ranks
            for row in log["log"] if row["case"] == case and row["epoch"] == epoch]


def epochs(entries, case):
    return [e for e in entries if e["loader"] == case and "window" not in e]


def test_tokens_per_group_on_a_mesh_are_counted_once_never_times_tp(launched):
    """(dp, tp) = (2, 2): each group's tokens are what its tp=0 rank's loop received (its tp=1
    peer received the same rows); the total is the groups', not the 4 ranks' (2x)."""
    logs, entries, _ = launched
    got = epochs(entries, "sft")
    assert [e["epoch"] for e in got] == [0, 1]
    for e in got:
        firsts = {log["rank"]: log["coordinate"] for log in logs if log["coordinate"][1] == 0}
        per_group = [sum(sum(r["tokens"]) for r in rows(logs, "sft", e["epoch"], [rank]))
                     for rank in sorted(firsts, key=lambda r: firsts[r][0])]
        every_rank = sum(sum(r["tokens"]) for r in rows(logs, "sft", e["epoch"]))
        assert e["tokens"]["per_group"] == per_group
        assert e["tokens"]["total"] == sum(per_group) == every_rank // 2
        assert e["tokens"]["skew"] == pytest.approx(max(per_group) / (sum(per_group) / 2))
        samples = sum(len(r["ids"]) for r in rows(logs, "sft", e["epoch"], list(firsts)))
        assert e["tokens"]["padding_share"] == pytest.approx(1 - sum(per_group) / (samples * T))
        assert e["tokens"]["supervised"] == sum(
            sum(r["supervised"]) for r in rows(logs, "sft", e["epoch"], list(firsts)))
        skew = next(v for v in e["verdicts"] if v["verdict"] == "token-skew-within-limit")
        assert skew["ok"] == (e["tokens"]["skew"] <= 1.5)


def test_the_realized_mixture_is_what_the_loop_received_and_datasets_dealt(launched):
    """interleave_datasets(probabilities=(0.7, 0.3), seed=0) over 140 and 60 rows: the mixed
    dataset's own sources (built here again) are each dealt once over the 4 ranks; the watch's
    counts are those, and those the loops logged."""
    sys.path.insert(0, str(LOOP.parent))
    from tokens_loop import mixture

    dealt = [int(s) for s in mixture()["source"]]
    logs, entries, _ = launched
    for case in ("mix", "mixwrong"):
        for e in epochs(entries, case):
            logged = [s for r in rows(logs, case, e["epoch"]) for s in r["sources"]]
            assert sorted(logged) == sorted(dealt)
            for name in ("0", "1"):
                assert e["sources"][name]["samples"] == logged.count(int(name))
                assert e["sources"][name]["share"] == pytest.approx(
                    logged.count(int(name)) / len(logged))
    verdict = {case: [next(v for v in e["verdicts"] if v["verdict"] == "mixture-matches-weights")
                      for e in epochs(entries, case)] for case in ("mix", "mixwrong", "weighted")}
    assert all(v["ok"] for v in verdict["mix"] + verdict["weighted"])
    # the weights given the other way round: n = 168; source '0' at weight 0.3: 168 x 0.3 =
    # 50.4, sd = sqrt(168 x 0.3 x 0.7) = 5.94, half-band 5 x 5.94 + 1 = 30.7: 19.7-81.1
    assert all(not v["ok"] and "weight 30.0%: outside 20-81" in v["detail"]
               for v in verdict["mixwrong"])
    weighted = epochs(entries, "weighted")[0]
    logged = [s for r in rows(logs, "weighted", 0) for s in r["sources"]]
    assert weighted["sources"]["0"]["samples"] == logged.count(0)


def test_named_sources_are_counted_as_the_loops_received_them(launched):
    """The mixture with its sources named (strings, not indices: the epoch's end exchanges
    them as objects, not in the window's row): each name's samples are those the loops
    logged, and datasets dealt each row once over the 4 ranks."""
    sys.path.insert(0, str(LOOP.parent))
    from tokens_loop import mixture

    dealt = list(mixture(names=("web", "code"))["source"])
    logs, entries, _ = launched
    got = epochs(entries, "named")
    assert [e["epoch"] for e in got] == [0, 1]
    for e in got:
        logged = [s for r in rows(logs, "named", e["epoch"]) for s in r["sources"]]
        assert sorted(logged) == sorted(dealt)
        assert {name: e["sources"][name]["samples"] for name in e["sources"]} == {
            "web": logged.count("web"), "code": logged.count("code")}
        assert next(v for v in e["verdicts"] if v["verdict"] == "mixture-matches-weights")["ok"]


def test_the_lineage_gives_each_ranks_tokens_at_a_step(launched):
    """sharddemo lineage DIR --step K, with tokens=: each rank's tokens at that step (the tp=1
    peers' too) are those its loop's mask held (6 steps an epoch: steps 0 and 8)."""
    logs, _, out = launched
    for step in (0, 8):
        shown = json.loads(sharddemo(["lineage", str(out / "lineage-sft"), "--step", str(step),
                                      "--format", "json"]).stdout)
        assert len(shown["batches"]) == 4
        for b in shown["batches"]:
            mine = rows(logs, "sft", step // 6, [b["rank"]])[step % 6]
            assert b["ids"] == mine["ids"] and b["tokens"] == sum(mine["tokens"])
    text = sharddemo(["lineage", str(out / "lineage-sft"), "--step", "0"]).stdout
    assert " tokens: " in text


def test_a_failing_window_carries_each_groups_tokens_so_far(launched):
    """sftworld: tp peers differ, so the first window (steps 1-2) fails; its entry holds each
    group's tokens over the steps before it was exchanged (its first ranks' logged masks)."""
    logs, entries, _ = launched
    (window,) = [e for e in entries if e["loader"] == "sftworld" and "window" in e]
    last = window["window"]["last_step"]
    firsts = sorted((log["coordinate"][0], log["rank"]) for log in logs
                    if log["coordinate"][1] == 0)
    per_group = [sum(sum(r["tokens"]) for r in rows(logs, "sftworld", 0, [rank])[:last])
                 for _, rank in firsts]
    assert window["tokens"]["per_group"] == per_group


def test_a_resumed_epochs_tokens_count_what_came_before_the_stop(launched):
    """sftresume: every rank saved its StatefulDataLoader's state after 3 steps of epoch 0 and
    a fresh watched loader took the rest. The resumed epoch's tokens and supervised tokens are
    those of every row the groups' first ranks (0 and 2) received, before the stop and after
    it, as the epoch's samples are (before: only the part after the restart)."""
    logs, entries, _ = launched
    [entry] = [e for e in epochs(entries, "sftresume") if e.get("resume")
               and not e.get("partial")]
    got = rows(logs, "sftresume", 0, ranks=(0, 2))
    assert [r["step"] for r in rows(logs, "sftresume", 0, ranks=(0,))] == list(range(
        len(rows(logs, "sftresume", 0, ranks=(0,)))))
    assert entry["seen"] == sum(len(r["ids"]) for r in got)
    per_group = [sum(t for r in rows(logs, "sftresume", 0, ranks=(first,)) for t in r["tokens"])
                 for first in (0, 2)]
    assert entry["tokens"]["per_group"] == per_group
    assert entry["tokens"]["supervised"] == sum(s for r in got for s in r["supervised"])
    assert "after_restart" not in entry["tokens"]
