"""What PyTorch's CUDA caching allocator counts as allocated for tensors made one after another into
an empty pool, as a model's parameters are when it is built on the device.

The allocator's `allocated` figure (the peak ablate measures) counts blocks, not tensors. A request
is rounded up to 512 bytes. One of at most 1 MiB comes from the small pool (2 MiB segments); a
larger one from the large pool, whose new segments are 20 MiB for requests under 10 MiB and the
request rounded up to 2 MiB otherwise. The smallest free block that fits is taken and split, unless
what would remain is too small to be worth keeping (under 512 bytes in the small pool, at most 1 MiB
in the large one): then the whole block is the tensor's. So a parameter of 20,480,000 bytes (a bf16
gpt2-xl MLP weight) sits in a 20 MiB block, 0.47 MiB beyond it. The rules are c10/cuda's
CUDACachingAllocator.cpp (round_size, get_allocation_size, get_free_block, should_split) with its
default settings; played here over the parameters in build order, they give every recorded model's
allocator peak after the build to 0.05 MiB (tests/test_allocator_blocks.py).
"""
from __future__ import annotations

from collections.abc import Iterable

MIB = 2**20
MIN_BLOCK = 512  # every request rounded up to a multiple of this
SMALL_SIZE = MIB  # requests up to this come from the small pool
SMALL_SEGMENT = 2 * MIB  # the small pool's segments
LARGE_SEGMENT = 20 * MIB  # the large pool's segments for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MIB  # at and above this a request gets a segment of its own size ...
ROUND_LARGE = 2 * MIB  # ... rounded up to this


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def blocks_bytes(sizes: Iterable[int]) -> int:
    """The bytes of the blocks holding tensors of `sizes` bytes, allocated in that order into an
    empty allocator and none freed."""
    free: dict[bool, list[int]] = {False: [], True: []}  # per pool (large or not), its free blocks
    total = 0
    for n in sizes:
        size = _round_up(max(int(n), 1), MIN_BLOCK)
        large = size > SMALL_SIZE
        pool = free[large]
        fitting = [b for b in pool if b >= size]
        if fitting:
            block = min(fitting)
            pool.remove(block)
        elif not large:
            block = SMALL_SEGMENT
        else:
            block = LARGE_SEGMENT if size < MIN_LARGE_ALLOC else _round_up(size, ROUND_LARGE)
        rest = block - size
        if rest > SMALL_SIZE if large else rest >= MIN_BLOCK:  # split: the rest stays free
            pool.append(rest)
            block = size
        total += block
    return total


def slack_bytes(sizes: list[int]) -> int:
    """How much more than the tensors themselves their blocks hold (see blocks_bytes)."""
    return blocks_bytes(sizes) - sum(sizes)
