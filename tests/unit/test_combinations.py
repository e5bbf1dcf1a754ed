"""A guard for combinations, in one process: features crossed with each other must not crash.

hypothesis draws a loader (mode x N x B x W x shuffle x drop_last x even_batches x
split_batches x epochs), the libraries' own objects deal every rank's batches
(tests/support/oracle.py: torch's DistributedSampler, accelerate's prepare_data_loader), the
batches become an epoch record as the ranks write it (ids, or counts as rank/counting.py reduces
them), and every renderer and the plot read the report, with an audit's verdicts and a resume
beside. The properties: the JSON validates against docs/report.schema.json, the table and the
markdown show every mode and epoch asked for, the PNG is drawn or refused with one UsageError
(which the CLI raises before any rank starts). The CLI's own refusals and a sampled subset on
real ranks: tests/ranks/test_combinations.py."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import numpy as np
import pytest
import xxhash
from support.launch import SCHEMA
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.oracle import Case, all_ranks

from sharddemo.analysis import build_report
from sharddemo.errors import UsageError
from sharddemo.render import render

KEEP = 3  # counting.KEEP_BATCHES: the batches a rank keeps at each end of a counted epoch


def ids_record(epoch: int, ranks: list[list[list[int]]], gather: str) -> dict:
    """The record rank.recorder.epoch_record writes (main-process workers: -1)."""
    return {"epoch": epoch, "gather": gather,
            "ranks": [{"rank": r, "batches": b, "workers": [-1] * len(b)}
                      for r, b in enumerate(ranks)],
            "gathered_for_metrics": None, "remainder": [None] * len(ranks)}


def counted_record(epoch: int, ranks: list[list[list[int]]], n: int) -> dict:
    """The record a counting Recorder returns on the main rank, with its collectives done
    in this process: each rank's counter encoded (counting.encode), the codes summed (the
    reduce), and counting.summarise on the sum."""
    from sharddemo.rank.counting import encode, summarise

    world = len(ranks)
    codes, shift, rows = None, None, []
    for r, batches in enumerate(ranks):
        ids = [i for b in batches for i in b]
        inside = [i for i in ids if 0 <= i < n]
        counts = np.bincount(np.asarray(inside, dtype=np.int64), minlength=max(n, 1))
        counts = np.minimum(counts, 255).astype(np.uint8)
        code, shift = encode(counts.copy(), world)
        codes = code.astype(np.int64) if codes is None else codes + code
        repeats = sorted((i, c) for i, c in Counter(inside).items() if c > 1)
        sizes: list[list[int]] = []
        for b in batches:
            if sizes and sizes[-1][0] == len(b):
                sizes[-1][1] += 1
            else:
                sizes.append([len(b), 1])
        head, tail = batches[:KEEP], batches[KEEP:][-KEEP:]
        rows.append({"rank": r, "steps": len(batches), "samples": len(ids), "sizes": sizes,
                     "workers": {-1: [len(batches), len(ids)]} if batches else {},
                     "head": head, "tail": tail, "head_workers": [-1] * len(head),
                     "tail_workers": [-1] * len(tail),
                     "repeats": [[i, c] for i, c in repeats][:1000],
                     "repeats_total": len(repeats), "distinct": len(set(inside)),
                     "out_of_range": sorted({i for i in ids if not 0 <= i < n}),
                     "out_of_range_total": len(ids) - len(inside),
                     "order_hash": xxhash.xxh3_128(np.asarray(ids, dtype=np.int64)).hexdigest(),
                     "ascending": ids == sorted(ids), "remainder": None})
    record = summarise(epoch, codes[:n], shift, rows)
    record["coverage"]["for_metrics"] = None
    return record


MODES = ("prepared", "sampler", "replicated", "double-split", "unseeded")


@st.composite
def loaders(draw):
    world = draw(st.sampled_from([2, 3]))
    b = draw(st.integers(1, 6))
    split = draw(st.booleans()) and b % world == 0
    # N smaller than, equal to and not divisible by the global batch
    g = b if split else b * world
    n = draw(st.sampled_from([1, max(1, g - 1), g, g + 1, 2 * g + 1, 3 * g]))
    return Case(mode=draw(st.sampled_from(MODES)), n=n, b=b, world=world,
                shuffle=draw(st.booleans()), drop_last=draw(st.booleans()),
                even_batches=draw(st.booleans()), split_batches=split,
                set_epoch=draw(st.booleans()), seed=draw(st.integers(0, 3)),
                epochs=draw(st.integers(1, 3)))


def loader_description(case: Case) -> dict:
    """What rank.describe.describe_loader says of the case's loader, written from the case (the fields
    the analysis reads)."""
    prepared = case.mode in ("prepared", "double-split", "unseeded")
    return {"prepared": prepared, "distributed_sampler": case.mode in ("sampler", "double-split"),
            "batch_sampler_shard": prepared, "even_batches": case.even_batches,
            "drop_last": case.drop_last, "split_batches": case.split_batches,
            "seedable_sampler": case.mode == "unseeded", "shuffled": case.shuffle}


def trace_of(case: Case, gather: str, audit: bool) -> dict:
    epochs = all_ranks(case)
    records = [counted_record(k, ranks, case.n) if gather == "count"
               else ids_record(k, ranks, gather) for k, ranks in enumerate(epochs)]
    mode = "audit" if audit else case.mode
    g = case.b if case.split_batches else case.b * case.world
    options = {"drop_last": case.drop_last}
    if audit:
        options["audit"] = {"expect": "replicated" if case.mode == "replicated" else "sharded"}
    return {"world_size": case.world, "backend": "gloo", "dataset_size": case.n,
            "batch_size": case.b, "global_batch": g, "epochs": case.epochs, "seed": case.seed,
            "source": "toy", "options": options,
            "modes": {mode: {"description": f"{case.mode} (drawn)", "epochs": records,
                             "loader": loader_description(case),
                             "prepared": loader_description(case)["prepared"],
                             **({"role": "train", "set_epoch_called": case.set_epoch}
                                if audit else {})}}}


def resume_of(trace: dict, mode: str) -> dict:
    """A resume object (resume.compare_resume) where the run stopped after one step of epoch 0
    and the resumed launch dealt the rest: read from the same library batches."""
    from sharddemo.analysis.resume import compare_resume, explain
    from sharddemo.options import ResumePlan

    epochs = trace["modes"][mode]["epochs"]
    stop = {"world_size": trace["world_size"],
            "epochs": [{"ranks": [{"batches": r["batches"][:1]} for r in epochs[0]["ranks"]]}]}
    resumed = {"world_size": trace["world_size"],
               "epochs": [{"ranks": [{"batches": r["batches"][1:]} for r in e["ranks"]]}
                          for e in epochs[:2]]}
    plan = ResumePlan.at(0, 1)
    result = compare_resume(plan, {"world_size": trace["world_size"], "epochs": epochs[:2]},
                            stop, resumed)
    result["explanation"] = explain(result)
    return result


def check_renders(report: dict) -> None:
    """Every format renders; JSON validates; the table and markdown show every mode and epoch."""
    jsonschema.validate(json.loads(render(report, "json")), SCHEMA)
    for fmt in ("table", "markdown"):
        text = render(report, fmt)
        for mode, data in report["modes"].items():
            assert re.search(rf"(== |## ){re.escape(mode)}\b", text), (fmt, mode)
            for e in data["epochs"]:
                assert f"epoch {e['epoch']}" in text, (fmt, mode, e["epoch"])
            if data.get("resume"):
                assert data["resume"]["explanation"] in text, (fmt, "resume")
        for row in report.get("resume") or []:
            assert f"stop {row['at']['epoch']}:{row['at']['step']}" in text, (fmt, "resume rows")


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=loaders(), gather=st.sampled_from(["batch", "epoch", "count"]),
       audit=st.booleans(), resume=st.booleans(), plot=st.booleans())
def test_every_combination_reports_and_renders(tmp_path_factory, case, gather, audit, resume,
                                               plot):
    trace = trace_of(case, gather, audit)
    report = json.loads(json.dumps(build_report(trace)))
    mode = next(iter(report["modes"]))
    assert [e["epoch"] for e in report["modes"][mode]["epochs"]] == list(range(case.epochs))
    if audit and resume and case.epochs >= 2 and gather != "count":
        report["modes"][mode]["resume"] = resume_of(trace, mode)
    check_renders(report)
    if plot:
        pytest.importorskip("matplotlib")
        from sharddemo.plot import plot_report

        path = tmp_path_factory.mktemp("png") / "split.png"
        if gather == "count":
            with pytest.raises(UsageError, match="--plot draws every id"):
                plot_report(report, str(path))
            assert not path.exists()
        else:
            drawn = plot_report(report, str(path))
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and mode in drawn


@pytest.mark.parametrize("gather", ["epoch", "count"])
def test_a_million_samples_through_every_format(gather):
    """N = 10^6 on 3 ranks, torch's own DistributedSampler dealing batches of 100,000 (the
    count path's size, where ids and counts must both render)."""
    from torch.utils.data import DistributedSampler

    n, b, world = 1_000_000, 100_000, 3
    ranks = []
    for r in range(world):
        order = list(DistributedSampler(range(n), num_replicas=world, rank=r, seed=0))
        ranks.append([order[i:i + b] for i in range(0, len(order), b)])
    record = (counted_record(0, ranks, n) if gather == "count" else ids_record(0, ranks, gather))
    trace = {"world_size": world, "backend": "gloo", "dataset_size": n, "batch_size": b,
             "epochs": 1, "seed": 0, "source": "toy", "options": {},
             "modes": {"sampler": {"description": "sampler", "epochs": [record],
                                   "loader": {"distributed_sampler": True}}}}
    report = json.loads(json.dumps(build_report(trace)))
    e = report["modes"]["sampler"]["epochs"][0]
    # ceil(10^6 / 3) = 333,334 per rank: 1,000,002 dealt, the first 2 of the order again
    assert (e["seen"], e["unique"], e["duplicate_count"]) == (1_000_002, 1_000_000, 2)
    assert e["duplicates"][0]["reason"] == "sampler-padding"
    check_renders(report)


def test_the_resume_demo_renders_in_every_format():
    """`compare --modes resume` reports rows, not modes: every format shows each row."""
    from sharddemo.options import demo_scenarios

    case = Case(mode="prepared", n=16, b=4, world=2, seed=1)
    trace = trace_of(case, "batch", audit=True)
    one = resume_of(trace, "audit")
    rows = [{**one, "at": {"epoch": sc["epoch"], "step": sc["step"]},
             "strategy": sc["strategy"], "workers": sc["workers"]} for sc in demo_scenarios(2)]
    report = {"schema": "sharddemo.report/1", "world_size": 2, "backend": "gloo",
              "distributed_type": "MULTI_CPU", "device": "cpu", "dataset_size": 16,
              "batch_size": 4, "global_batch": 8, "epochs": 3, "seed": 1, "source": "toy",
              "options": {}, "config_file": None, "launch_command": None, "modes": {},
              "broken_promises": [], "resume": rows}
    check_renders(report)
    for fmt in ("table", "markdown"):
        assert render(report, fmt).count("resume-exact") == len(rows)
