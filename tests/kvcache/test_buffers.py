"""PagedKVCache: slot writes land in the right block, blocks move between caches and bytes intact."""

from __future__ import annotations

import ctypes
import mmap
import resource
import sys

import pytest
import torch

from kvstrata.kvcache.buffers import KVCacheSpec, PagedKVCache
from tests.model.model_helpers import cuda_only

SPEC = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


def filled(spec: KVCacheSpec, num_blocks: int, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(spec, num_blocks)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def test_sizes():
    assert SPEC.block_shape == (3, 2, 2, 4, 8)
    assert SPEC.bytes_per_block == 3 * 2 * 2 * 4 * 8 * 4
    assert PagedKVCache.blocks_for_budget(SPEC, 10 * SPEC.bytes_per_block + 1) == 10
    assert PagedKVCache.blocks_for_budget(SPEC, SPEC.bytes_per_block - 1) == 0
    assert PagedKVCache(SPEC, 5).nbytes == 5 * SPEC.bytes_per_block
    with pytest.raises(ValueError):
        PagedKVCache(SPEC, 0)


def test_write_by_slot_lands_in_block_and_offset():
    cache = PagedKVCache(SPEC, 6)
    k = torch.randn(3, 2, 8)                     # (T, KVH, D)
    v = torch.randn(3, 2, 8)
    slots = torch.tensor([5 * 4 + 3, 0 * 4 + 0, 2 * 4 + 1])
    cache.write(1, slots, k, v)
    layer = cache.layer(1)                       # (2, KVH, N, bs, D)
    for t, (block, offset) in enumerate([(5, 3), (0, 0), (2, 1)]):
        assert torch.equal(layer[0, :, block, offset], k[t])
        assert torch.equal(layer[1, :, block, offset], v[t])
    assert cache.layer(0).abs().sum() == 0 and cache.layer(2).abs().sum() == 0


def test_blocks_move_between_caches_with_all_layers():
    device, host = filled(SPEC, 8, seed=1), PagedKVCache(SPEC, 5)
    host.write_blocks([4, 0], device.read_blocks([6, 2]))
    assert torch.equal(host.data[:, :, :, 4], device.data[:, :, :, 6])
    assert torch.equal(host.data[:, :, :, 0], device.data[:, :, :, 2])
    assert host.data[:, :, :, 1:4].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_bytes_round_trip(dtype):
    spec = KVCacheSpec(2, 1, 4, 2, dtype)
    src, dst = filled(spec, 3, seed=2), PagedKVCache(spec, 4)
    raw = src.read_block(1)
    assert isinstance(raw, bytes) and len(raw) == spec.bytes_per_block
    dst.write_block(3, memoryview(raw))
    assert torch.equal(dst.read_blocks([3]), src.read_blocks([1]))
    with pytest.raises(ValueError, match="bytes"):
        dst.write_block(0, raw[:-1])


def test_tier_copies_move_blocks_both_ways_and_only_gpu_to_cpu_waits_for_the_stream():
    from kvstrata.kvcache.mover import TierBuffers, needs_sync_before_cpu_read
    device, host = filled(SPEC, 6, seed=1), filled(SPEC, 4, seed=2)
    buffers = TierBuffers(device, host, "fp")
    buffers.copy("device", "host", [(5, 0), (2, 3)])
    assert torch.equal(host.read_blocks([0, 3]), device.read_blocks([5, 2]))
    buffers.copy("host", "device", [(3, 1)])
    assert torch.equal(device.read_blocks([1]), device.read_blocks([2]))
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert needs_sync_before_cpu_read(gpu, cpu)
    assert not needs_sync_before_cpu_read(cpu, gpu) and not needs_sync_before_cpu_read(cpu, cpu)


@cuda_only
def test_gpu_to_pinned_host_copies_are_complete_before_the_cpu_reads_them():
    """A non-blocking device->host copy read without waiting could store stale KV with a valid checksum."""
    from kvstrata.kvcache.mover import TierBuffers, host_cache
    device = PagedKVCache(SPEC, 64, "cuda")
    host = host_cache(device, 64)
    buffers = TierBuffers(device, host, "fp")
    for round_ in range(20):
        device.data.normal_()
        buffers.copy("device", "host", [(i, 63 - i) for i in range(64)])
        assert torch.equal(host.read_blocks(list(range(63, -1, -1))), device.read_blocks(list(range(64))).cpu())


def _drop_pages(cache: PagedKVCache) -> None:
    """Unmap the cache's whole pages (MADV_DONTNEED: they read as zeros again, the cache was zero)."""
    page, start = mmap.PAGESIZE, cache.data.data_ptr()
    first = -(-start // page) * page
    last = (start + cache.nbytes) // page * page
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(first, last - first, 4) == 0            # MADV_DONTNEED


def _minor_faults_writing(cache: PagedKVCache) -> int:
    """Page faults taken writing one value into every 4 KiB of the cache (its contents kept)."""
    flat = cache.data.view(-1)
    step = 4096 // flat.element_size()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    flat[::step] += 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_map_pages_faults_the_cache_in_ahead_and_keeps_its_contents():
    spec = KVCacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = (64 * 2**20) // spec.bytes_per_block                       # 64 MiB
    fresh, cache = PagedKVCache(spec, num_blocks), PagedKVCache(spec, num_blocks)
    for c in (fresh, cache):        # as a fresh mmap is (the allocator may hand out memory it had mapped)
        _drop_pages(c)
    assert _minor_faults_writing(fresh) > 0                                  # lazily zeroed: writes fault
    cache.data[1, 0, 1, 7].fill_(3.0)                                       # written before it is mapped
    calls = 0
    while cache.map_pages(8 * 2**20):
        calls += 1
    if calls == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert calls == -(-cache.nbytes // (8 * 2**20)) and not cache.map_pages(8 * 2**20)
    assert _minor_faults_writing(cache) <= 2                                 # every page already mapped
    assert (cache.data[1, 0, 1, 7] == 3.0).all() and int((cache.data != 0).sum()) == 16 * 64
