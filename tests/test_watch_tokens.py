"""The watch's tokens and sources: tokens per data-parallel group (each group once on a mesh,
never x tp), their skew and padding; the realized mixture of sources against the weights, with a
band that widens with the count.

Real ranks: torchrun, 4 gloo processes (tests/tokens_loop.py logs what each rank's loop
received: each sample's tokens from its mask, its supervised tokens, its source). Expected
values from those logs, from datasets' interleave_datasets itself, and from numpy's multinomial
for the band's rule."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from conftest import free_port, run_cmd
from test_frameworks import fresh_accelerate_state  # noqa: F401
from sharddemo import watch
from sharddemo.analysis.tokens import mixture_check, normalized

LOOP = Path(__file__).resolve().parent / "tokens_loop.py"
SCHEMA = json.loads((LOOP.parent.parent / "docs" / "watch.schema.json").read_text())
T = 16  # (tokens_loop's row length)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens")
    run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
             "--master_port", str(free_port()), str(LOOP), str(out)], timeout=240)
    logs = [json.loads((out / f"log{r}.json").read_text()) for r in range(4)]
    entries = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    for entry in entries:
        jsonschema.validate(entry, SCHEMA)
    return logs, entries


def rows(logs, case, epoch, ranks=None):
    return [row for log in logs if ranks is None or log["rank"] in ranks
            for row in log["log"] if row["case"] == case and row["epoch"] == epoch]


def epochs(entries, case):
    return [e for e in entries if e["loader"] == case and "window" not in e]


def test_tokens_per_group_on_a_mesh_are_counted_once_never_times_tp(launched):
    """(dp, tp) = (2, 2): each group's tokens are what its tp=0 rank's loop received (its tp=1
    peer received the same rows); the total is the groups', not the 4 ranks' (2x)."""
    logs, entries = launched
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
    logs, entries = launched
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


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20_000), st.lists(st.floats(0.05, 1.0), min_size=1, max_size=5),
       st.integers(0, 2**32 - 1))
def test_a_mixture_drawn_with_its_weights_stays_inside_the_band(n, weights, seed):
    """numpy's multinomial with the weights: inside the band (a false alarm once in about 1.7
    million checks a source: beyond 5 sd)."""
    p = np.array(weights) / sum(weights)
    counts = np.random.default_rng(seed).multinomial(n, p)
    check = mixture_check({str(i): int(k) for i, k in enumerate(counts)},
                          normalized(list(weights)))
    assert check["ok"], check


@settings(max_examples=40, deadline=None)
@given(st.integers(5_000, 50_000), st.floats(0.1, 0.5), st.integers(0, 2**32 - 1))
def test_a_mixture_off_by_ten_points_is_caught_from_five_thousand_samples(n, p, shift_seed):
    """Two sources configured (p, 1 - p), drawn (p + 0.1, 0.9 - p): at n >= 5,000 the band
    (at most 5 x sqrt(n / 4) + 1, 1.8% of n) is far narrower than the 10-point shift."""
    counts = np.random.default_rng(shift_seed).multinomial(n, [p + 0.1, 0.9 - p])
    check = mixture_check({"0": int(counts[0]), "1": int(counts[1])}, {"0": p, "1": 1 - p})
    assert not check["ok"]
    assert 5 * math.sqrt(n / 4) + 1 < 0.1 * n


@pytest.mark.parametrize("kwargs,words", [
    ({"weights": [1, 1]}, "weights need sources="),
    ({"sources": "s", "weights": [1, -1]}, "weights must be"),
    ({"sources": "s", "weights": {}}, "weights must be"),
    ({"max_token_skew": 1.2}, "max_token_skew needs tokens="),
    ({"tokens": "mask", "max_token_skew": 0.5}, "max_token_skew must be a number >= 1"),
])
def test_token_and_source_arguments_are_refused_in_one_line_at_watch(kwargs, words):
    with pytest.raises(ValueError, match=words) as error:
        watch(DataLoader(torch.arange(4)), report=None, **kwargs)
    assert "\n" not in str(error.value)


def test_one_process_counts_a_mask_and_labels_by_hand(tmp_path):
    """4 rows of 3 slots, masks [1,1,0], [1,0,0], [1,1,1], [0,0,0] (6 tokens of 12: padding
    50%); labels with 3 entries other than -100; two batches of 2."""
    masks = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    labels = torch.tensor([[-100, 5, -100], [-100, -100, -100], [4, 4, -100], [-100] * 3])
    data = [{"attention_mask": m, "labels": lab} for m, lab in zip(masks, labels)]
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(data, batch_size=2), report=str(report),
                   tokens=("attention_mask", "labels"))
    for _ in loader:
        pass
    loader.close()
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["tokens"]["total"] == 6 and entry["tokens"]["supervised"] == 3
    assert entry["tokens"]["padding_share"] == pytest.approx(0.5)


class Masked(torch.utils.data.Dataset):
    """Sample i: x = [i, i], a mask of length 1 + i % 4 over 4 slots, source i % 3."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        mask = torch.zeros(4, dtype=torch.int64)
        mask[:1 + i % 4] = 1
        return {"x": torch.tensor([float(i), float(i)]), "attention_mask": mask,
                "source": i % 3}


def test_the_trainer_callback_counts_what_the_model_received(tmp_path,
                                                             fresh_accelerate_state):  # noqa: F811
    """TrainerWatch(tokens=, sources=, weights=), one process, 24 samples in batches of 4, 1
    epoch: the tokens and sources the model's forward itself received."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from sharddemo.integrations import TrainerWatch

    seen = {"tokens": 0, "sources": []}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def forward(self, x, attention_mask, source):
            seen["tokens"] += int(attention_mask.sum())
            seen["sources"] += source.tolist()
            return {"loss": self.layer(x).pow(2).mean()}

    report = tmp_path / "w.jsonl"
    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1,
                             per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", remove_unused_columns=False)
    Trainer(model=Model(), args=args, train_dataset=Masked(),
            callbacks=[TrainerWatch(report=str(report), tokens="attention_mask",
                                    sources="source", weights=[1, 1, 1])]).train()
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["tokens"]["total"] == seen["tokens"]
    assert {k: v["samples"] for k, v in entry["sources"].items()} == {
        str(s): seen["sources"].count(s) for s in (0, 1, 2)}


def test_the_lightning_callback_counts_what_the_steps_received(tmp_path):
    """LightningWatch(tokens=, sources=), one device, 24 samples in batches of 4, 1 epoch: the
    tokens and sources each training_step itself received."""
    pl = pytest.importorskip("pytorch_lightning")
    from sharddemo.integrations import LightningWatch

    seen = {"tokens": 0, "sources": []}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, index):
            seen["tokens"] += int(batch["attention_mask"].sum())
            seen["sources"] += batch["source"].tolist()
            return self.layer(batch["x"]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    report = tmp_path / "w.jsonl"
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                         default_root_dir=str(tmp_path), enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[LightningWatch(report=str(report), tokens="attention_mask",
                                                   sources="source")])
    trainer.fit(Module(), DataLoader(Masked(), batch_size=4, shuffle=True))
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["tokens"]["total"] == seen["tokens"]
    assert {k: v["samples"] for k, v in entry["sources"].items()} == {
        str(s): seen["sources"].count(s) for s in (0, 1, 2)}
