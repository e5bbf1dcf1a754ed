"""The lineage file's encoding (lineage_format.py, format 2), in one process: one chunk's bytes
worked out by hand; then properties over random runs (hypothesis): whatever batches a rank's
loop receives (sizes 0 to 70, ids up to 2^40 and across the whole int64 range, runs, shuffled
ranges, repeats, batches of unknown ids, epoch changes, restarts from a checkpoint), what is
written reads back as exactly those batches, the expected values being the batches given;
and a file cut at any byte of its last chunk reads back the chunks before it, and nothing
false. The end-to-end tests (watched loops, real ranks) are tests/ranks/test_lineage.py."""

from __future__ import annotations

import os
import struct
import types
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharddemo.errors import UsageError
from sharddemo.lineage import Lineage, RankLineage
from sharddemo.lineage_format import (BATCH, RESTART, UNKNOWN, encode, encode_many, file_header,
                                      rank_file, valid_length)

FAST = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def test_one_chunk_byte_by_byte():
    """Steps 7 and 8 of epoch 2: the batch [5, 3] and the batch [9, 10, 11] (a run)."""
    data = encode_many([BATCH, BATCH], [2, 2], [7, 8], [2, 3], np.array([5, 3, 9, 10, 11]))
    # by hand, the payload: the runs' bitmap 0b10 (batch 1 is a run); the sizes 2 and 3 at 2
    # bits, the first in the lowest bits: 0b11_10 = 0x0E; the stored ids 5, 3, 9 (the run's
    # first) at 4 bits (the largest, 9, needs 4): 0x35 then 0x09
    payload = bytes([0b10, 0x0E, 0x35, 0x09])
    # the header: kind 0 (batches), id width 4, size width 2, flags RUNS (2), epoch 2, first
    # step 7, 2 batches, size 0 (they differ), payload length 4, then the CRC-32 of the rest
    head = struct.pack("<BBBBIQIII", 0, 4, 2, 2, 2, 7, 2, 0, 4)
    assert data == head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload
    # a restart: a header alone; and one batch of ids stored from a base: the 8 bytes of the
    # base, -1, then the ids less it, 0 and 2^40 + 2, at 41 bits (82 bits: 11 bytes)
    assert len(encode(RESTART, 0, 3)) == 32
    assert len(encode(BATCH, 0, 0, np.array([-1, 2**40 + 1]))) == 32 + 8 + 11


def test_a_file_of_another_format_version_is_refused(tmp_path):
    path = rank_file(str(tmp_path), 0)
    # format 1's header, by hand: the magic, version 1, rank 0; then one 24-byte record
    with open(path, "wb") as handle:
        handle.write(b"SDLINEAG" + struct.pack("<II", 1, 0) + bytes(24))
    message = (f"{path} is a lineage file of format 1, written by an earlier sharddemo; this one "
               "reads and writes format 2: read it with the sharddemo that wrote it, and give a "
               "new lineage folder to a new run")
    with pytest.raises(UsageError) as error:
        RankLineage(path, 0)
    assert str(error.value) == message
    with pytest.raises(UsageError) as error:  # the writer's check before a resumed run appends
        valid_length(path)
    assert str(error.value) == message


# -- what a rank's loop may receive -----------------------------------------------------------

ID = st.integers(0, 2**40)
BATCHES = st.one_of(
    st.lists(ID, max_size=70),  # any ids, repeats included
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=5),  # the whole int64 range
    st.tuples(ID, st.integers(0, 70)).map(lambda a: list(range(a[0], a[0] + a[1]))),  # a run
    st.tuples(st.integers(0, 1000), st.integers(1, 70), st.randoms(use_true_random=False)).map(
        lambda a: a[2].sample(range(a[0], a[0] + a[1]), a[1])),  # a shuffled range
    st.none())  # ids not known
EVENT = st.one_of(
    st.tuples(st.just("batch"), BATCHES),
    st.tuples(st.just("batch"), st.just([7, 8, 9, 10])),  # the same batch again and again
    st.just(("epoch",)),
    st.just(("flush",)),
    st.tuples(st.just("restart"), st.integers(0, 5)))
EVENTS = st.lists(EVENT, max_size=60)


def expected_after(events):
    """What a reader must give for these events, worked out from the events alone: the
    (step, epoch, ids) of every batch, where a restart `back` steps before the current one
    drops the steps written from there on (they are superseded) and the steps go on from it."""
    rows, epoch, restarts = [], 0, []
    for event in events:
        if event[0] == "batch":
            rows.append((len(rows), epoch, event[1]))
        elif event[0] == "epoch":
            epoch += 1
        elif event[0] == "restart":
            step = max(0, len(rows) - event[1])
            rows = rows[:step]
            restarts.append(step)
    return rows, restarts


def write(path, events) -> list[int]:
    """The events encoded as the writer does (a chunk per flush, a restart record of its own);
    returns where each write began."""
    pending, epoch, step, starts = [], 0, 0, []
    with open(path, "wb") as handle:
        handle.write(file_header(0))

        def flush():
            if pending:
                starts.append(handle.tell())
                ids = [i for _, _, b in pending if b is not None for i in b]
                handle.write(encode_many([UNKNOWN if b is None else BATCH for _, _, b in pending],
                                         [e for e, _, _ in pending], [s for _, s, _ in pending],
                                         [0 if b is None else len(b) for _, _, b in pending],
                                         np.array(ids, dtype=np.int64)))
                pending.clear()

        for event in events:
            if event[0] == "batch":
                pending.append((epoch, step, event[1]))
                step += 1
            elif event[0] == "epoch":
                epoch += 1  # (not flushed: one call may carry several epochs)
            elif event[0] == "flush":
                flush()
            elif event[0] == "restart":
                flush()
                step = max(0, step - event[1])
                starts.append(handle.tell())
                handle.write(encode(RESTART, epoch, step))
        flush()
    return starts


def read(path) -> tuple[list, RankLineage]:
    lineage = RankLineage(path, 0)
    rows = [(int(lineage.step[r]), int(lineage.epoch[r]),
             None if lineage.kind[r] == UNKNOWN else lineage.ids(r))
            for r in range(len(lineage.step))]
    assert all(k in (BATCH, UNKNOWN) for k in lineage.kind.tolist())
    return rows, lineage


@FAST
@given(EVENTS)
def test_any_batches_round_trip(tmp_path_factory, events):
    path = str(tmp_path_factory.mktemp("lineage") / "rank0.lineage")
    write(path, events)
    rows, lineage = read(path)
    expected, restarts = expected_after(events)
    assert rows == expected
    assert lineage.restarts == restarts and lineage.torn == 0
    assert valid_length(path) == os.path.getsize(path)
    for step, epoch, ids in expected:  # the step lookup
        row = lineage.row_of(step)
        assert row is not None and int(lineage.epoch[row]) == epoch
    # where each id was received (and one never received): the steps that hold it
    for sample in {i for _, _, ids in expected for i in ids or []} | {2**40 + 1}:
        holding = [step for step, _, ids in expected if ids and sample in ids]
        assert [int(lineage.step[r]) for r in lineage.rows_with(sample)] == holding


LAST = st.one_of(st.lists(ID, max_size=20), st.lists(st.integers(-2**63, 2**63 - 1),
                                                     min_size=1, max_size=3),
                 st.tuples(ID, st.integers(2, 70)).map(lambda a: list(range(a[0], a[0] + a[1]))))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(EVENT, max_size=20), st.lists(LAST, min_size=1, max_size=4))
def test_a_file_cut_anywhere_in_its_last_chunk_reads_the_chunks_before(tmp_path_factory,
                                                                        events, last):
    """The events, then a last flush of `last` (one chunk: consecutive steps of one epoch);
    the file cut at every byte of that chunk, as a crash in its write leaves it."""
    path = str(tmp_path_factory.mktemp("lineage") / "rank0.lineage")
    everything = events + [("flush",)] + [("batch", b) for b in last]
    starts = write(path, everything)
    whole = open(path, "rb").read()
    chunk = starts[-1]
    before, _ = expected_after(events)
    full, _ = expected_after(everything)
    assert read(path)[0] == full
    for cut in range(len(whole) - 1, chunk - 1, -1):
        os.truncate(path, cut)  # (opening a file to write it anew is slow on some disks)
        rows, lineage = read(path)
        assert rows == before, cut
        assert lineage.torn == cut - chunk
        assert valid_length(path) == chunk  # what the writer keeps before it appends
    # one byte of the last chunk changed, anywhere: that chunk is dropped, or a lookup of
    # its ids says the file is damaged; never other ids
    with open(path, "wb") as handle:
        handle.write(whole)
    descriptor = os.open(path, os.O_WRONLY)
    try:
        for at in range(chunk, len(whole)):
            os.pwrite(descriptor, bytes([whole[at] ^ 0x10]), at)
            lineage = RankLineage(path, 0)
            for r in range(len(lineage.step)):
                step = int(lineage.step[r])
                try:
                    got = None if lineage.kind[r] == UNKNOWN else lineage.ids(r)
                except UsageError as error:
                    assert "(the file was damaged after it was written)" in str(error)
                    continue
                assert step < len(full) and (step, int(lineage.epoch[r]), got) == full[step]
            os.pwrite(descriptor, whole[at:at + 1], at)
    finally:
        os.close(descriptor)


# -- through the watch's own writer -----------------------------------------------------------

LAUNCH = st.lists(st.one_of(
    st.tuples(st.just("batch"), BATCHES),
    st.just(("epoch",)),
    st.just(("checkpoint",)),
    st.just(("relaunch",))), max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(LAUNCH)
def test_the_writer_round_trips_a_run_with_its_resumes(tmp_path_factory, events):
    """LineageWriter as the watch drives it: append(epoch, ids tensor or None) a batch; a
    checkpoint (place()); a relaunch: the writer closed, a new one resumed from the last
    checkpoint (skipped before the first checkpoint of an opened writer). Expected: the
    batches appended, each launch's from the checkpoint's step on; the earlier launch's steps
    after that checkpoint dropped once the resumed launch writes (its first batch)."""
    from sharddemo.watching.lineage import LineageWriter

    folder = str(tmp_path_factory.mktemp("lineage"))
    state = types.SimpleNamespace(accelerator=None, n=None, name="train", epoch=0)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", "0")
        env.setenv("WORLD_SIZE", "1")
        writer = LineageWriter(folder, state)
        expected: list = []
        saved = resumed = None
        for event in events:
            if event[0] == "batch":
                ids = None if event[1] is None else torch.tensor(event[1], dtype=torch.int64)
                writer.append(state.epoch, ids)
                if resumed is not None:
                    expected, resumed = resumed, None
                expected.append((len(expected), state.epoch, event[1]))
            elif event[0] == "epoch":
                state.epoch += 1
            elif event[0] == "checkpoint":
                saved = (writer.place(), state.epoch, list(expected))
            elif event[0] == "relaunch" and saved is not None and saved[0]["run_id"]:
                writer.close()
                place, state.epoch, resumed = saved[0], saved[1], list(saved[2])
                writer = LineageWriter(folder, state)
                writer.resume(place)
        writer.close()
    if not expected:
        return
    lineage = Lineage(folder)
    rows, _ = read(rank_file(folder, 0))
    assert rows == expected
    assert lineage.at_step(len(expected) - 1)[0]["ids"] == expected[-1][2]


def test_packing_is_bit_by_bit_at_every_width():
    """pack() against the format's definition, bit by bit: value i's bit b is bit i*width + b
    of the stream, bit j of the stream bit j % 8 of byte j // 8; every width 1..64, lengths
    around a group of 8."""
    from sharddemo.lineage_format import pack, unpack

    rng = np.random.default_rng(0)
    for width in range(1, 65):
        for n in (1, 7, 8, 9, 17, 64):
            values = [int(x) % 2**width for x in rng.integers(0, 2**64, n, dtype=np.uint64)]
            bits = [(value >> b) & 1 for value in values for b in range(width)]
            bits += [0] * (-len(bits) % 8)
            stream = bytes(sum(bits[j + i] << i for i in range(8)) for j in range(0, len(bits), 8))
            assert pack(np.array(values, dtype=np.uint64), width) == stream, (width, n)
            assert unpack(stream, n, width).tolist() == values, (width, n)


def test_the_reader_module_still_gives_the_format_names():
    """The format moved to sharddemo.lineage_format; `from sharddemo.lineage import encode, ...`
    (scripts written before the move) still gives the same objects. The names are the ones
    sharddemo.lineage offered before the move, written out here."""
    import sharddemo.lineage as reader
    import sharddemo.lineage_format as fmt

    names = ["BASE", "BATCH", "CHUNK", "CHUNK_BATCHES", "CHUNK_RESTART", "FILE_HEADER", "FLAGS",
             "MAGIC", "MAX_CHUNK_BATCHES", "MAX_CHUNK_IDS", "RESTART", "RUN_FILE", "RUNS",
             "SCHEMA", "U64", "UNIFORM", "UNKNOWN", "UNKNOWNS", "VERSION", "Layout",
             "validate_version", "encode", "encode_chunk", "encode_many", "file_header", "pack",
             "rank_file", "unpack", "valid_length", "walk"]
    assert all(getattr(reader, name) is getattr(fmt, name) for name in names)
    assert set(names) <= set(reader.__all__)
    for name in ("Lineage", "RankLineage", "read_run_file", "write_run_file"):
        assert name in reader.__all__ and callable(getattr(reader, name))
