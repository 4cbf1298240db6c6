"""Test-only placeholder for SGLang's CUDA kernel package, on the servers' PYTHONPATH:
SGLang imports a few of its names at start-up; with torch-native attention on this CPU
none is called, and one that were would raise here. Not part of the package."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def placeholder(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is a test placeholder; the test run "
                                  "reached a CUDA kernel")

    placeholder.__name__ = name
    return placeholder
