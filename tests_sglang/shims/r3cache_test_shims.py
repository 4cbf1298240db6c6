"""Test-only SGLang plugin (entry point in r3cache_test_shims-0.dist-info, on the servers'
PYTHONPATH): host buffers without CUDA's page-locking, which SGLang's default allocator
asks of a CUDA runtime this CPU build of torch does not have (the routed-experts host
cache is one such buffer). Not part of the package."""


def register() -> None:
    from sglang.srt.mem_cache.pool_host import common

    def allocate_unpinned(dims, dtype, device, pin_memory, allocator,
                          registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    common.ALLOC_MEMORY_FUNCS["cpu"] = allocate_unpinned
