"""Tokens and sources in one process: the mixture's band against numpy's multinomial, the
arguments refused at watch(), a mask and labels counted by hand, and the Trainer's and
Lightning's callbacks against what the model itself received."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from sharddemo import watch
from sharddemo.analysis.tokens import judge_mixture, normalized


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20_000), st.lists(st.floats(0.05, 1.0), min_size=1, max_size=5),
       st.integers(0, 2**32 - 1))
def test_a_mixture_drawn_with_its_weights_stays_inside_the_band(n, weights, seed):
    """numpy's multinomial with the weights: inside the band (a false alarm once in about 1.7
    million checks a source: beyond 5 sd)."""
    p = np.array(weights) / sum(weights)
    counts = np.random.default_rng(seed).multinomial(n, p)
    check = judge_mixture({str(i): int(k) for i, k in enumerate(counts)},
                          normalized(list(weights)))
    assert check["ok"], check


@settings(max_examples=40, deadline=None)
@given(st.integers(5_000, 50_000), st.floats(0.1, 0.5), st.integers(0, 2**32 - 1))
def test_a_mixture_off_by_ten_points_is_caught_from_five_thousand_samples(n, p, shift_seed):
    """Two sources configured (p, 1 - p), drawn (p + 0.1, 0.9 - p): at n >= 5,000 the band
    (at most 5 x sqrt(n / 4) + 1, 1.8% of n) is far narrower than the 10-point shift."""
    counts = np.random.default_rng(shift_seed).multinomial(n, [p + 0.1, 0.9 - p])
    check = judge_mixture({"0": int(counts[0]), "1": int(counts[1])}, {"0": p, "1": 1 - p})
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
                                                             fresh_accelerate_state):
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


def test_a_mask_of_segment_numbers_counts_its_nonzero_entries_per_source(tmp_path):
    """A packer's mask may number its rows' segments (1, 2, ...; 0 padding): the tokens are its
    nonzero entries, by hand: rows [1,1,2,0] (3 tokens, source 0), [1,2,2,3] (4, source 1),
    [0,0,0,0] (0, source 0), [3,3,0,0] (2, source 1): 9 tokens, source 0 has 3, source 1 has 6."""
    masks = torch.tensor([[1, 1, 2, 0], [1, 2, 2, 3], [0, 0, 0, 0], [3, 3, 0, 0]])
    data = [{"mask": m, "source": k % 2} for k, m in enumerate(masks)]
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(data, batch_size=2), report=str(report), tokens="mask",
                   sources="source")
    for _ in loader:
        pass
    loader.close()
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["tokens"]["total"] == 9
    assert {k: v["tokens"] for k, v in entry["sources"].items()} == {"0": 3, "1": 6}


def test_named_sources_count_the_slots_once(tmp_path):
    """Sources given as names (a list of str): the padding share is the mask's, as with int
    sources. By hand: masks [1,1,0,0], [1,0,0,0], [1,1,1,0], [0,0,0,0]: 6 tokens of 16 slots,
    padding 62.5%; sources web, code, web, code: web 5 tokens, code 1."""
    masks = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    data = [{"mask": m, "source": "web" if k % 2 == 0 else "code"} for k, m in enumerate(masks)]
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(data, batch_size=2), report=str(report), tokens="mask",
                   sources="source", weights={"web": 0.5, "code": 0.5})
    for _ in loader:
        pass
    loader.close()
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["tokens"]["padding_share"] == pytest.approx(1 - 6 / 16)
    assert {k: v["tokens"] for k, v in entry["sources"].items()} == {"web": 5, "code": 1}


def test_int_sources_against_weights_by_name_say_the_names_differ(tmp_path):
    """Sources 0, 1, 0, 1 (indices) with weights {"web": .5, "code": .5} (names): no count is
    wrong, the names are; the verdict says so and how to give the weights (not "outside the
    band")."""
    data = [{"x": k, "source": k % 2} for k in range(4)]
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(data, batch_size=2), report=str(report), sources="source",
                   weights={"web": 0.5, "code": 0.5})
    for _ in loader:
        pass
    loader.close()
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    [verdict] = [v for v in entry["verdicts"] if v["verdict"] == "mixture-matches-weights"]
    assert not verdict["ok"]
    assert verdict["detail"].startswith(
        "the batches' sources (indices '0', '1') are none of the weights' ('web', 'code'): "
        "give weights as a list in the sources' index order")


@pytest.mark.parametrize("kwargs", [{"tokens": "attention_mask"}, {"sources": "source"}])
def test_a_missing_token_or_source_field_is_named_without_the_id_fields_hint(kwargs):
    """Batches that are one tensor (4 ids each) have no field 'attention_mask' or 'source':
    the error names the argument, and not id_field's "pass '.'" (a batch is never its tokens)."""
    loader = watch(DataLoader(torch.arange(8), batch_size=4), report=None, **kwargs)
    [(name, field)] = kwargs.items()
    with pytest.raises(ValueError) as error:
        for _ in loader:
            pass
    said = str(error.value)
    assert said.startswith(f"sharddemo.watch: {name}={field!r}: the batches (Tensor of shape "
                           f"(4,)) have no field {field!r}")
    assert "pass '.'" not in said and "\n" not in said


def test_the_sources_line_says_it_counts_repeats_where_the_samples_line_does_not():
    """An epoch of 58 distinct samples received 60 times (a DistributedSampler's padding
    repeated 2): the sources' shares are over the 60 received (by hand: 45 web, 15 code), and
    the line says so; over 60 distinct, nothing more is said."""
    from sharddemo.analysis.tokens import tokens_words

    sources = {"code": {"samples": 15, "share": 0.25}, "web": {"samples": 45, "share": 0.75}}
    assert tokens_words({"unique": 58, "sources": sources}) == (
        ", sources (of all 60 received, repeats too) code 25.0% / web 75.0%")
    assert tokens_words({"unique": 60, "sources": sources}) == ", sources code 25.0% / web 75.0%"


def _resumed_epoch(tmp_path, drop_tokens_before: bool) -> tuple[dict, list[dict]]:
    """One process, a StatefulDataLoader of 8 rows (batch 2, in order), watched with tokens= and
    sources=; its state saved after 2 steps, loaded into a fresh watched loader that takes the
    rest. Returns the resumed epoch's entry and every row the two loops received."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    masks = [[1] * (k % 4 + 1) + [0] * (3 - k % 4) for k in range(8)]  # 1..4 tokens of 4
    data = [{"id": k, "mask": torch.tensor(masks[k]), "source": k % 2} for k in range(8)]
    report = tmp_path / "w.jsonl"
    kw = dict(report=str(report), id_field="id", tokens="mask", sources="source")
    received = []
    first = watch(StatefulDataLoader(data, batch_size=2), **kw)
    for step, batch in enumerate(first):
        received += [{"id": int(i), "mask": m.tolist(), "source": int(s)}
                     for i, m, s in zip(batch["id"], batch["mask"], batch["source"])]
        if step == 1:
            state = first.state_dict()
            break
    first.close()  # (the stopped launch's part: a partial entry)
    if drop_tokens_before:  # a checkpoint the watch saved before it kept the tokens so far
        import io

        part = torch.load(io.BytesIO(state["_sharddemo_watch"]), weights_only=True)
        part.pop("tokens_before")
        buffer = io.BytesIO()
        torch.save(part, buffer)
        state["_sharddemo_watch"] = buffer.getvalue()
    second = watch(StatefulDataLoader(data, batch_size=2), **kw)
    second.load_state_dict(state)
    for batch in second:
        received += [{"id": int(i), "mask": m.tolist(), "source": int(s)}
                     for i, m, s in zip(batch["id"], batch["mask"], batch["source"])]
    second.close()
    entries = [json.loads(line) for line in report.read_text().splitlines()]
    [entry] = [e for e in entries if e.get("resume") and not e.get("partial")]
    return entry, received


def test_a_resumed_epochs_tokens_and_sources_count_the_whole_epoch(tmp_path):
    """Resumed from the loader's own state after 2 of 4 steps: the epoch's tokens and sources
    are those of every row the two loops received (before the stop and after), as its samples
    are, not only the rows after the restart."""
    entry, received = _resumed_epoch(tmp_path, drop_tokens_before=False)
    assert sorted(r["id"] for r in received) == list(range(8))
    assert entry["tokens"]["total"] == sum(sum(r["mask"]) for r in received)
    assert "after_restart" not in entry["tokens"]
    for name in ("0", "1"):
        mine = [r for r in received if str(r["source"]) == name]
        assert entry["sources"][name]["samples"] == len(mine)
        assert entry["sources"][name]["tokens"] == sum(sum(r["mask"]) for r in mine)


def test_a_resumed_epoch_without_the_tokens_before_the_stop_says_so(tmp_path):
    """The same, from a checkpoint that holds no tokens so far: the figures are the rows
    after the restart (the last 4 received), and the entry and its line say so."""
    entry, received = _resumed_epoch(tmp_path, drop_tokens_before=True)
    after = received[4:]
    assert entry["tokens"]["total"] == sum(sum(r["mask"]) for r in after)
    assert entry["tokens"]["after_restart"] is True
    assert sum(row["samples"] for row in entry["sources"].values()) == len(after)
    from sharddemo.analysis.tokens import tokens_words

    words = tokens_words(entry)
    assert f", {entry['tokens']['total']:,} tokens after the restart" in words
    assert ", sources after the restart (of its 4 received)" in words


@pytest.mark.parametrize("width", [1, 8, 13, 2040, 2048, 8200])
def test_each_rows_count_is_torchs_count_of_its_nonzero_entries(width):
    """row_sums (a bool tensor's bytes summed eight at a time) against torch's own
    count_nonzero(dim=1): widths that are no multiple of 8, one lane's limit (255 words, 2,040
    bytes) and beyond it, a slice that starts at an odd byte, and a transposed view."""
    from sharddemo.watching.tokens import row_sums

    g = torch.Generator().manual_seed(width)
    flags = torch.rand(6, width + 1, generator=g) < 0.7
    flags[0] = True  # (a row of all ones: every lane at its most)
    for view in (flags[:, :width], flags[:, 1:], flags[:, :width].contiguous(),
                 flags.t().contiguous().t()):
        assert torch.equal(row_sums(view).to(torch.int64), torch.count_nonzero(view, dim=1))


def test_batches_of_several_widths_and_a_tokenizers_mask_count_every_row(tmp_path):
    """Batches padded each to its longest row (a collator's dynamic padding: widths 3, 5, 2
    ...), an int64 attention_mask and labels, int sources: the tokens, the supervised tokens
    and each source's tokens are torch's counts of the rows the loop received."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (150,), generator=g).tolist()
    rows = [{"attention_mask": torch.ones(n, dtype=torch.int64),
             "labels": torch.where(torch.rand(n, generator=g) < 0.5, -100, 7),
             "source": k % 3} for k, n in enumerate(lengths)]

    def pad(batch):
        width = max(len(r["attention_mask"]) for r in batch)
        return {"attention_mask": torch.stack([torch.nn.functional.pad(
                    r["attention_mask"], (0, width - len(r["attention_mask"])))
                    for r in batch]),
                "labels": torch.stack([torch.nn.functional.pad(
                    r["labels"], (0, width - len(r["labels"])), value=-100) for r in batch]),
                "source": torch.tensor([r["source"] for r in batch])}

    seen = {"tokens": 0, "supervised": 0, "by_source": {0: 0, 1: 0, 2: 0}}
    report = tmp_path / "w.jsonl"
    loader = watch(DataLoader(rows, batch_size=2, collate_fn=pad), report=str(report),
                   tokens=("attention_mask", "labels"), sources="source")
    for batch in loader:
        per_row = torch.count_nonzero(batch["attention_mask"], dim=1)
        seen["tokens"] += int(per_row.sum())
        seen["supervised"] += int(torch.count_nonzero(batch["labels"] != -100))
        for s, n in zip(batch["source"].tolist(), per_row.tolist()):
            seen["by_source"][s] += n
    loader.close()
    (entry,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert entry["tokens"]["total"] == seen["tokens"] == sum(lengths)
    assert entry["tokens"]["supervised"] == seen["supervised"]
    assert {k: v["tokens"] for k, v in entry["sources"].items()} == {
        str(s): n for s, n in seen["by_source"].items()}


def test_a_batch_with_a_source_too_few_is_an_error_even_where_another_has_one_too_many():
    """Two batches of 4 rows, the first with 3 sources and the second with 5 (7 + 1 = 8 in all,
    as many as the rows): each batch's sources against its own rows, so torch's bincount
    refuses the first (weights of 4 for 3 indices), as when each batch was summed alone; never
    the sources moved between the batches' rows."""
    from sharddemo.watching.tokens import TokenMeter

    meter = TokenMeter("attention_mask", "source")
    mask = torch.ones(4, 3, dtype=torch.int64)
    meter.add({"attention_mask": mask, "source": torch.tensor([0, 1, 2])})
    meter.add({"attention_mask": mask, "source": torch.tensor([0, 1, 2, 0, 1])})
    with pytest.raises(RuntimeError):
        meter.settle()


def test_nonzero_bytes_is_torchs_bool_of_the_join_and_leaves_the_batches_alone():
    """nonzero_bytes against torch's own `.bool()` of the join, byte for byte: int8 entries 0,
    1, 2, -1, 127, -128 (a mask of segment numbers, and bytes whose sign bit is set), uint8
    entries 0, 1, 2, 255, bool, a lone tensor (not joined), and int8 with uint8 (joined as
    int16). By hand for the int8 batches: [[0, 1, 2], [-1, 127, -128]] and [[0, 0, 3]] flag
    [[0, 1, 1], [1, 1, 1]] and [[0, 0, 1]]; the batches keep their values."""
    from sharddemo.watching.tokens import nonzero_bytes

    int8 = (torch.tensor([[0, 1, 2], [-1, 127, -128]], dtype=torch.int8),
            torch.tensor([[0, 0, 3]], dtype=torch.int8))
    uint8 = (torch.tensor([[0, 1], [2, 255]], dtype=torch.uint8),
             torch.tensor([[255, 0]], dtype=torch.uint8))
    flags = (torch.tensor([[True, False]]), torch.tensor([[False, False], [True, True]]))
    cases = [int8, uint8, flags, int8[:1], (int8[1], torch.tensor([[255, 0, 7]], dtype=torch.uint8))]
    for values in cases:
        before = [v.clone() for v in values]
        got = nonzero_bytes(values)
        want = torch.cat(values).bool()
        assert got.element_size() == 1 and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert all(torch.equal(v, b) for v, b in zip(values, before))
    assert nonzero_bytes(int8).tolist() == [[0, 1, 1], [1, 1, 1], [0, 0, 1]]


def test_row_sums_count_an_int8_masks_flags_as_torch_counts_its_nonzero_entries():
    """row_sums of nonzero_bytes' int8 flags (not bools) against count_nonzero(dim=1) of the
    batches themselves: entries -128..127, widths of 8 and 16 bytes (the words' path) and 5."""
    from sharddemo.watching.tokens import nonzero_bytes, row_sums

    g = torch.Generator().manual_seed(0)
    for width in (5, 8, 16):
        batches = tuple(torch.randint(-128, 128, (3, width), generator=g, dtype=torch.int8)
                        * (torch.rand(3, width, generator=g) < 0.5) for _ in range(4))
        assert torch.equal(row_sums(nonzero_bytes(batches)).to(torch.int64),
                           torch.count_nonzero(torch.cat(batches), dim=1))


@pytest.mark.parametrize("bits,rows_limit", [(27, 1 << 26), (9, 1 << 26), (27, 40), (6, 1 << 26)])
def test_each_sources_samples_and_tokens_are_torchs_counts_whatever_the_packed_bounds(
        monkeypatch, bits, rows_limit):
    """Each source's samples and tokens summed packed (one bincount: PACK + a row's tokens) are
    torch's counts of the rows the meter was given: an int8 mask with entries -1, 0, 1, 2 (12
    slots a row), int sources 0..4, batches of 1-7 rows summed 3 at a time; with the bounds as
    shipped, and made small (PACK 2^9: a fold every few sums; 40 rows: a fold every sum or
    two; PACK 2^6 = 64 entries, under one sum's: those summed unpacked), read midway
    (so_far) and at the end."""
    import sharddemo.watching.tokens as tokens

    monkeypatch.setattr(tokens, "PACK_BITS", bits)
    monkeypatch.setattr(tokens, "PACK", 1 << bits)
    monkeypatch.setattr(tokens, "PACKED_ROWS", rows_limit)
    monkeypatch.setattr(tokens.TokenMeter, "SETTLE_BATCHES", 3)
    g = torch.Generator().manual_seed(bits + rows_limit)
    meter = tokens.TokenMeter("mask", "source")
    seen_rows, seen_sources = [], []
    for step in range(40):
        n = int(torch.randint(1, 8, (1,), generator=g))
        mask = torch.randint(-1, 3, (n, 12), generator=g).to(torch.int8)
        source = torch.randint(0, 5, (n,), generator=g)
        meter.add({"mask": mask, "source": source})
        seen_rows.append(torch.count_nonzero(mask, dim=1))
        seen_sources.append(source)
        if step == 20:
            assert meter.so_far() == int(torch.cat(seen_rows).sum())
    rows, sources = torch.cat(seen_rows).tolist(), torch.cat(seen_sources).tolist()
    part = meter.take()
    assert part["tokens"] == sum(rows)
    assert part["slots"] == 12 * len(rows)
    assert part["sources"] == {str(s): [sources.count(s),
                                        sum(r for r, k in zip(rows, sources) if k == s)]
                               for s in sorted(set(sources))}


def test_a_batch_of_no_rows_among_others_counts_nothing():
    """A batch of 0 rows (a mask of shape (0, 4), no sources) between two of 2 rows, each
    summed alone (a window's read of the tokens so far after each): by hand, masks [1,1,0,0],
    [1,0,0,0] (sources 0, 1) and [1,1,1,0], [0,0,0,0] (sources 1, 1): 6 tokens of 16 slots,
    source 0 one sample of 2 tokens, source 1 three samples of 4; the empty batch neither
    counts nor fails (it was torch's error once: its flags reshaped to (0, -1))."""
    from sharddemo.watching.tokens import TokenMeter

    for dtype in (torch.int8, torch.int64):
        meter = TokenMeter("mask", "source")
        meter.add({"mask": torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=dtype),
                   "source": torch.tensor([0, 1])})
        assert meter.so_far() == 3
        meter.add({"mask": torch.zeros(0, 4, dtype=dtype),
                   "source": torch.zeros(0, dtype=torch.int64)})
        assert meter.so_far() == 3
        meter.add({"mask": torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]], dtype=dtype),
                   "source": torch.tensor([1, 1])})
        assert meter.take() == {"tokens": 6, "slots": 16, "supervised": None,
                                "sources": {"0": [1, 2], "1": [3, 4]}}
