"""The lineage's on-disk format (docs/watch.md, "The batch behind a step"), once: the watch's
writer (sharddemo.watching.lineage) encodes with the functions here, and the reader
(sharddemo.lineage) walks and decodes with them. No torch.

A lineage folder holds:

- `lineage.json`, written by rank 0 when its loop receives its first batch: the schema, the
  run id, the world size, the dataset's length where known, the loader's name;
- `rank{r}.lineage` per rank, append-only: a 16-byte file header (MAGIC, the format version,
  the rank), then one chunk per write of the writer (every 256 batches, an epoch's change, a
  checkpoint, the exit), each holding the consecutive steps of one epoch.

A chunk is a 32-byte header (`CHUNK`: kind, id width in bits, size width in bits, flags, epoch,
first step, batch count, the batches' size where they all have one, payload length, CRC-32 of
the header's other fields and the payload), then its payload, each part byte-aligned:

1. with `BASE`: an int64 subtracted from every stored id (negative ids, or ids all far from 0);
2. with `UNKNOWNS`: one bit a batch, set for a batch whose ids the watch could not attribute
   (it keeps the step count true; no ids);
3. with `RUNS`: one bit a batch, set for a batch of 2 or more consecutive ascending ids, which
   is stored as its first id alone;
4. unless `UNIFORM` (every known batch has the header's size): the known batches' sizes,
   packed at the size width;
5. the stored ids (every id of a plain batch, the first of a run), minus the base, packed at
   the id width: the fewest bits the chunk's largest stored id needs (18 for ids below
   2 x 10^5, 27 below 10^8, up to 64), little-endian bit order.

A `RESTART` chunk (no batches, no payload) marks a resume from a checkpoint: its step is the
first step of the resumed launch, and any batch of an earlier launch from that step on (written
after the checkpoint the run resumed from) is superseded.

A crash can leave the last chunk cut short: it fails its length or CRC check and is skipped
(`RankLineage.torn` says how many bytes); the writer cuts it off before a resumed run appends.
Steps count the batches a rank's loop received, from 0, across epochs and resumes.
Format 2 (this one) replaced format 1 (a 24-byte header and uint32 or int64 ids per batch);
a format-1 file is refused with a message that says so.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Optional

import numpy as np

from sharddemo.errors import UsageError

SCHEMA = "sharddemo.lineage/1"
RUN_FILE = "lineage.json"
MAGIC = b"SDLINEAG"
VERSION = 2
FILE_HEADER = struct.Struct("<8sII")  # magic, version, rank: 16 bytes
# kind, id width, size width, flags, epoch, first step, batches, size, payload length, crc
CHUNK = struct.Struct("<BBBBIQIIII")  # 32 bytes
BATCH, RESTART, UNKNOWN = 0, 1, 2  # what a step (a row of the reader) is
CHUNK_BATCHES, CHUNK_RESTART = 0, 1  # what a chunk is
UNIFORM, RUNS, UNKNOWNS, BASE = 1, 2, 4, 8  # a chunk's flags
FLAGS = UNIFORM | RUNS | UNKNOWNS | BASE
# a chunk's limits (encode_many starts another past them): its payload stays well under the
# 4 GB its length field can say, and one chunk's decode well under a second
MAX_CHUNK_IDS = 1 << 24
MAX_CHUNK_BATCHES = 1 << 20
U64 = np.uint64


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.lineage")


def tokens_file(folder: str, rank: int) -> str:
    """The rank's tokens a step (watch(..., tokens=)): int64 pairs (step, tokens), appended."""
    return os.path.join(folder, f"rank{rank}.tokens")


def file_header(rank: int) -> bytes:
    return FILE_HEADER.pack(MAGIC, VERSION, rank)


def pack(values: np.ndarray, width: int) -> bytes:
    """`values` (uint64, each below 2**width) packed at `width` bits each, the first value in
    the lowest bits: ceil(len * width / 8) bytes. Vectorised, no loop over the values: every 8
    values fill `width` whole bytes, so the k-th value of each 8 starts at the same byte and
    bit of its group (k * width / 8), and each k is one strided OR into the groups' bytes."""
    n = len(values)
    if n == 0 or width == 0:
        return b""
    if width in (8, 16, 32, 64):
        return values.astype(f"<u{width // 8}").tobytes()
    nbytes = (n * width + 7) // 8
    if 8 <= width <= 57:  # (a value and its shift in 8 bytes; groups whose k-th do not overlap)
        groups = -(-n // 8)
        padded = np.zeros(groups * 8, dtype=U64)
        padded[:n] = values
        out = np.zeros(groups * width + 8, dtype=np.uint8)
        for k in range(8):
            into = np.ndarray((groups,), dtype="<u8", buffer=out, offset=k * width >> 3,
                              strides=(width,))
            into |= padded[k::8] << U64(k * width & 7)
        return out[:nbytes].tobytes()
    # the other widths: each 64-bit word is the OR of the values that start in it (one
    # reduceat), plus the high part of the one that started in the word before and spills
    bit = np.arange(n, dtype=U64) * U64(width)
    word = (bit >> U64(6)).astype(np.intp)
    shift = bit & U64(63)
    starts = np.flatnonzero(np.concatenate(([True], word[1:] != word[:-1])))
    words = np.zeros(nbytes // 8 + 2, dtype="<u8")
    words[word[starts]] = np.bitwise_or.reduceat(values << shift, starts)
    spill = np.flatnonzero(shift > U64(64 - width))
    if len(spill):  # (a word's start has one straddler at most: these indexes are distinct)
        words[word[spill] + 1] |= values[spill] >> (U64(64) - shift[spill])
    return words.view(np.uint8)[:nbytes].tobytes()


def unpack(data, n: int, width: int) -> np.ndarray:
    """The `n` values of `width` bits that pack() wrote at the start of `data`, as uint64."""
    if n == 0:
        return np.empty(0, dtype=U64)
    if width == 0:
        return np.zeros(n, dtype=U64)
    if width in (8, 16, 32, 64):
        return np.frombuffer(data, dtype=f"<u{width // 8}", count=n).astype(U64)
    nbytes = (n * width + 7) // 8
    mask = U64((1 << width) - 1)
    if width <= 57:  # the k-th value of every 8: one strided read of 8 bytes, one shift
        groups = -(-n // 8)
        padded = np.zeros(groups * width + 8, dtype=np.uint8)
        padded[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes)
        out = np.empty(groups * 8, dtype=U64)
        for k in range(8):
            np.right_shift(np.ndarray((groups,), dtype="<u8", buffer=padded,
                                      offset=k * width >> 3, strides=(width,)),
                           U64(k * width & 7), out=out[k::8])
        out &= mask
        return out[:n]
    words = np.zeros(nbytes // 8 + 2, dtype="<u8")
    words.view(np.uint8)[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes)
    bit = np.arange(n, dtype=U64) * U64(width)
    word = (bit >> U64(6)).astype(np.intp)
    shift = bit & U64(63)
    out = words[word] >> shift
    # the next word's bits, shifted up by 64 - shift: in two steps, so that a value that
    # starts on a word's first bit (shift 0) takes none (a shift by 64 is not defined)
    out |= (words[word + 1] << U64(1)) << (U64(63) - shift)
    return out & mask


def encode(kind: int, epoch: int, step: int, ids: Optional[np.ndarray] = None) -> bytes:
    """One step as a chunk of its own: a batch (its ids), a batch of unknown ids, or a restart."""
    ids = np.asarray(ids if ids is not None and kind == BATCH else [], dtype=np.int64)
    return encode_many([kind], [epoch], [step], [len(ids)], ids)


def encode_many(kinds, epochs, steps, counts, ids) -> bytes:
    """Several steps at once (the writer's buffer): `kinds` BATCH, UNKNOWN or RESTART each,
    `ids` all the batches' ids end to end, `counts` each batch's share (0 for the others).
    One chunk for each stretch of consecutive steps of one epoch (a restart a chunk of its
    own)."""
    kinds = np.asarray(kinds, dtype=np.int64)
    epochs = np.asarray(epochs, dtype=np.int64)
    steps = np.asarray(steps, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    ids = np.asarray(ids).astype(np.int64, copy=False).reshape(-1)
    n = len(kinds)
    if n == 0:
        return b""
    ends = np.cumsum(counts)
    starts = ends - counts
    cut = np.ones(n + 1, dtype=bool)
    cut[1:-1] = ((kinds[1:] == RESTART) | (kinds[:-1] == RESTART)
                 | (epochs[1:] != epochs[:-1]) | (steps[1:] != steps[:-1] + 1))
    bounds = np.flatnonzero(cut).tolist()
    out: list[bytes] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if kinds[a] == RESTART:
            head = CHUNK.pack(CHUNK_RESTART, 0, 0, 0, int(epochs[a]), int(steps[a]), 0, 0, 0,
                              0)[:-4]
            out += (head, struct.pack("<I", zlib.crc32(head)))
            continue
        while a < b:  # (a stretch past a chunk's limits: several chunks)
            end = min(b, a + MAX_CHUNK_BATCHES,
                      max(a + 1, int(np.searchsorted(ends, starts[a] + MAX_CHUNK_IDS,
                                                     side="right"))))
            out.append(encode_chunk(kinds[a:end], int(epochs[a]), int(steps[a]),
                                    counts[a:end], ids[starts[a]:ends[end - 1]]))
            a = end
    return b"".join(out)


def encode_chunk(kinds: np.ndarray, epoch: int, step: int, sizes: np.ndarray,
                 ids: np.ndarray) -> bytes:
    """One chunk of batches (steps step, step + 1, ...; UNKNOWN ones with size 0)."""
    count = len(kinds)
    unknown = kinds == UNKNOWN
    ends = np.cumsum(sizes)
    starts = ends - sizes
    # a run: 2 or more ids, each one more than the one before
    breaks = np.concatenate(([0], np.cumsum(np.diff(ids) != 1)))
    run = sizes >= 2
    run[run] = breaks[ends[run] - 1] == breaks[starts[run]]
    if run.any():  # a run keeps its first id
        inner = np.repeat(run, sizes)
        inner[starts[run]] = False
        stored = ids[~inner]
    else:
        stored = ids
    flags, parts, base, width = 0, [], 0, 0
    if len(stored):
        low, high = int(stored.min()), int(stored.max())
        width = (high - low).bit_length()
        # from 0 where that costs no more than the base's 8 bytes: the ids as they are
        if low >= 0 and (high.bit_length() - width) * len(stored) <= 64:
            width, low = high.bit_length(), 0
        else:
            flags |= BASE
            base = low
            parts.append(struct.pack("<q", low))
    if unknown.any():
        flags |= UNKNOWNS
        parts.append(np.packbits(unknown, bitorder="little").tobytes())
    if run.any():
        flags |= RUNS
        parts.append(np.packbits(run, bitorder="little").tobytes())
    known = sizes[~unknown]
    size, size_width = 0, 0
    if len(known) == 0 or (known == known[0]).all():
        flags |= UNIFORM
        size = int(known[0]) if len(known) else 0
    else:
        size_width = int(known.max()).bit_length()
        parts.append(pack(known.astype(U64), size_width))
    values = stored.view(U64) - U64(base % 2**64) if flags & BASE else stored.view(U64)
    parts.append(pack(values, width))
    payload = b"".join(parts)
    head = CHUNK.pack(CHUNK_BATCHES, width, size_width, flags, epoch, step, count, size,
                      len(payload), 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(payload, zlib.crc32(head))) + payload


class Layout:
    """A chunk's payload read up to its ids (no CRC check: decode() checks it): `base`,
    `unknown`, `run`, `size` per batch (0 for an unknown batch), where each batch's stored
    ids start (`start`), how many ids are stored, and where they lie in the file (`at`)."""

    def __init__(self, data, chunk: np.ndarray) -> None:
        (_, self.width, size_width, flags, _, _, count, size, at, length) = chunk.tolist()
        end = at + length
        self.base = 0
        if flags & BASE:
            (self.base,) = struct.unpack_from("<q", data, at)
            at += 8
        bitmap = (count + 7) // 8
        self.unknown = np.zeros(count, dtype=bool)
        self.run = np.zeros(count, dtype=bool)
        for flag, bits in ((UNKNOWNS, self.unknown), (RUNS, self.run)):
            if flags & flag:
                bits[:] = np.unpackbits(np.frombuffer(data, np.uint8, bitmap, at), count=count,
                                        bitorder="little").astype(bool)
                at += bitmap
        known = int(count - self.unknown.sum())
        self.size = np.zeros(count, dtype=np.int64)
        if flags & UNIFORM:
            self.size[~self.unknown] = size
        else:
            self.size[~self.unknown] = unpack(data[at:end], known, size_width).astype(np.int64)
            at += (known * size_width + 7) // 8
        per = np.where(self.run, 1, self.size)
        self.start = np.cumsum(per) - per
        self.stored = int(per.sum())
        self.at = at
        if at + (self.stored * self.width + 7) // 8 != end:
            raise ValueError("the chunk's parts do not add up to its length")


def validate_version(path: str, data) -> None:
    """UsageError for a file of another format version than this sharddemo reads."""
    (version,) = struct.unpack_from("<I", data, 8)
    if version != VERSION:
        raise UsageError(f"{path} is a lineage file of format {version}, written by "
                         f"{'an earlier' if version < VERSION else 'a later'} sharddemo; this "
                         f"one reads and writes format {VERSION}: read it with the sharddemo "
                         "that wrote it, and give a new lineage folder to a new run")


def walk(data) -> tuple[np.ndarray, int]:
    """The chunks of a rank file, by their headers: a row each (kind, id width, size width,
    flags, epoch, first step, batches, size, payload offset, payload length), and where the
    valid part ends. A chunk whose header is not one (a crash tore it) or that does not fit in
    the file ends the walk; so does a last chunk whose CRC fails (a crash tears the end only:
    the chunks before it are checked when a lookup decodes them)."""
    end = len(data)
    at = FILE_HEADER.size
    rows = []
    unpack_from = CHUNK.unpack_from
    while at + CHUNK.size <= end:
        kind, width, size_width, flags, epoch, step, count, size, length, _ = \
            unpack_from(data, at)
        if kind == CHUNK_BATCHES:
            whole = (0 < count <= MAX_CHUNK_BATCHES and width <= 64 and size_width <= 32
                     and not flags & ~FLAGS)
        else:
            whole = kind == CHUNK_RESTART and count == length == width == flags == 0
        if not whole or at + CHUNK.size + length > end:
            break
        rows.append((kind, width, size_width, flags, epoch, step, count, size,
                     at + CHUNK.size, length))
        at += CHUNK.size + length
    if rows:
        start, length = rows[-1][8], rows[-1][9]
        (crc,) = struct.unpack_from("<I", data, start - 4)
        if zlib.crc32(data[start:start + length],
                      zlib.crc32(data[start - CHUNK.size:start - 4])) != crc:
            rows.pop()
            at = start - CHUNK.size
    return np.array(rows, dtype=np.int64).reshape(-1, 10), at


def valid_length(path: str) -> int:
    """How much of a rank file is whole chunks (the writer cuts a torn tail before it
    appends again); UsageError for a file of another format version (a resumed run does not
    append format 2 chunks to it)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if len(data) < FILE_HEADER.size:
        return 0
    if data[:8] == MAGIC:
        validate_version(path, data)
    return walk(data)[1]
