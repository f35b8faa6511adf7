"""lz4 framing that stays range-readable, and the cheap "is this worth compressing?" test.

This module owns the stored layout of a compressed object and how it is written, nothing else
(no I/O, no trio); reading it back is cachemgr.format.decode's:

    raw:     [ frame 0: frame_size bytes ][ frame 1 ] ... [ frame n-1: 1..frame_size bytes ]
    stored:  [ lz4 frame 0 ][ lz4 frame 1 ] ... [ lz4 frame n-1 ]

Each raw frame of `frame_size` bytes (the last one shorter) is compressed into its own,
independent `lz4.frame` frame, and the stored frames are concatenated. The frame index is just
the list of stored frame lengths (it goes into the set manifest with the object): raw frame i
covers [i*frame_size, (i+1)*frame_size), and its stored bytes start at sum(lengths[:i]). A
ranged read therefore fetches only the stored frames that overlap the raw range and decompresses
them alone (`frames_for_range`, then cachemgr.format.decode).

Frame parameters (measured on this 2-core VM, 4 MiB frames, best of 30):
- lz4 block size 1 MiB (`BLOCKSIZE_MAX1MB`): 3.0 GB/s compress / 4.6 GB/s decompress on fp32
  randn, 12 GB/s / 3.6 GB/s on zeros. The 64 KiB default block was ~2x slower on randn; 4 MiB
  blocks decompressed zeros at 0.6 GB/s.
- No lz4 content checksum: xxh32 cut decompression to ~1.35 GB/s (3x slower). Integrity is
  end to end instead: the object's CRC32C of the raw content is checked after a full download,
  and every decompressed frame must have exactly its expected raw length. That length is also
  the bound on what decompression may produce (cachemgr.format.decode.ChunkDecoder): the
  frames come from the store, which is not trusted to be benign.
- `frame_size` 4 MiB: a random read decompresses at most ~4 MiB (~1 ms) of extra data, while the
  per-frame costs (a Python call, ~20 bytes of lz4 header, one int in the manifest: 256 per GiB)
  stay negligible.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import lz4.block
import lz4.frame

log = logging.getLogger(__name__)

MODES = ("auto", "lz4", "off")
DEFAULT_FRAME_SIZE = 4 << 20

# `--compress auto` samples SAMPLE_WINDOWS windows of SAMPLE_WINDOW bytes spread over the file:
# 512 KiB of lz4 "fast" work, ~13 us per incompressible window here (lz4 rejects incompressible
# data at several GB/s), so the decision costs ~0.1-1 ms per file whatever its size.
SAMPLE_WINDOWS = 8
SAMPLE_WINDOW = 64 << 10

# Compress only if the sampled ratio is at least 1.1 (saves >= 9% of the bytes sent and stored).
# Why not lower: trained fp32/bf16 weights and Adam moments give 1.00x with plain lz4 (measured
# early in development; the notes are not in the repository),
# and the framing overhead alone keeps random data at ~0.9999x, so the incompressible cluster
# sits at or just below 1.0; a threshold just above it would flip on sampling noise (we look at
# 512 KiB of a file that may be GBs). Below ~1.1 the saving also does not pay for what
# compression costs: CPU on the daemon's 2 cores (the bottleneck in those measurements),
# a whole 4 MiB frame decompressed for every small ranged read, and a frame index per object.
# Why not higher: at 1.1-1.5x (e.g. 50% zeros gives 1.46x) the store, not lz4, is the bottleneck
# (moto ~120 MB/s, S3 ~1 GB/s per stream vs lz4 at GB/s per core), so the saving is real time.
AUTO_MIN_RATIO = 1.1

_BLOCK_SIZE = lz4.frame.BLOCKSIZE_MAX1MB


def compress_frame(raw: bytes | memoryview) -> bytes:
    """One independent lz4 frame holding `raw` (fast mode, raw size stored in the header)."""
    out: bytes = lz4.frame.compress(raw, block_size=_BLOCK_SIZE, content_checksum=False,
                                    store_size=True, return_bytearray=False)
    return out


def frame_offsets(stored_lengths: Sequence[int]) -> list[int]:
    """Prefix sums: element i is the stored offset of frame i; the last element is the total."""
    out = [0] * (len(stored_lengths) + 1)
    acc = 0
    for i, n in enumerate(stored_lengths):
        acc += n
        out[i + 1] = acc
    return out


def frames_for_range(frame_size: int, stored_lengths: Sequence[int], offset: int, length: int,
                     *, offsets: Sequence[int] | None = None) -> tuple[int, int, int, int]:
    """The frames holding raw bytes [offset, offset+length): (first_frame, last_frame,
    stored_start, stored_end), with last_frame inclusive and stored_end exclusive. The range is
    clamped to the existing frames; `length` must be > 0 and `offset` inside the frames.
    `offsets` (from `frame_offsets`) makes this O(1) instead of a sum over the index."""
    if frame_size <= 0:
        raise ValueError(f"frame_size must be positive, got {frame_size}")
    if length <= 0 or offset < 0:
        raise ValueError(f"empty or negative range: offset={offset} length={length}")
    n = len(stored_lengths)
    first = offset // frame_size
    if first >= n:
        raise ValueError(f"offset {offset} is past the last of {n} frames")
    last = min((offset + length - 1) // frame_size, n - 1)
    if offsets is not None:
        start, end = offsets[first], offsets[last + 1]
    else:
        start = sum(stored_lengths[:first])
        end = start + sum(stored_lengths[first:last + 1])
    return first, last, start, end


def sample_ratio(sample_fn: Callable[[int, int], bytes], size: int) -> float:
    """Estimated lz4 ratio (raw/compressed) of a file of `size` bytes from a few windows.
    `sample_fn(offset, length)` returns raw bytes (e.g. an os.pread); it is called at most
    SAMPLE_WINDOWS times."""
    if size <= 0:
        return 1.0
    if size <= SAMPLE_WINDOWS * SAMPLE_WINDOW:
        windows = [(0, size)]  # small file: the whole of it is the sample
    else:
        # Evenly spread, first window at 0 and last one ending at EOF: torch.save files hold
        # different tensors at different offsets, so one contiguous sample would see one tensor.
        step = (size - SAMPLE_WINDOW) / (SAMPLE_WINDOWS - 1)
        windows = [(int(i * step), SAMPLE_WINDOW) for i in range(SAMPLE_WINDOWS)]
    raw_total = comp_total = 0
    for off, n in windows:
        data = sample_fn(off, n)
        if not data:
            continue
        raw_total += len(data)
        comp_total += len(lz4.block.compress(data, mode="fast", store_size=False))
    if raw_total == 0:
        return 1.0
    return raw_total / max(comp_total, 1)


def should_compress(sample_fn: Callable[[int, int], bytes], size: int) -> bool:
    """The `--compress auto` decision: compress iff the sampled lz4 ratio is >= AUTO_MIN_RATIO.
    Cost is bounded by SAMPLE_WINDOWS reads of SAMPLE_WINDOW bytes, whatever `size` is."""
    ratio = sample_ratio(sample_fn, size)
    log.debug("compress auto: sampled ratio %.3f over %d bytes", ratio, size)
    return ratio >= AUTO_MIN_RATIO
