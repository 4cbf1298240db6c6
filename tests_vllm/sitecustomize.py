"""Test-only shim, on PYTHONPATH for vLLM's processes in `make test-vllm`: a placeholder
"cpu" Triton backend, so vLLM's V2 model runner (needed for routed-experts capture) starts
under TRITON_INTERPRET=1 on a machine whose Triton has no CPU backend. Not part of the
package: a real deployment runs vLLM where Triton has a backend."""

try:
    import triton.backends as _backends

    if "cpu" not in _backends.backends:
        _backends.backends["cpu"] = _backends.Backend(compiler=object, driver=object)
except Exception:  # noqa: BLE001 - no triton, nothing to do
    pass
