def register():
    from sglang.srt.mem_cache.pool_host import common

    def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned
