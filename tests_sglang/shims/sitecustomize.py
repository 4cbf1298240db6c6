"""Test-only shim, on PYTHONPATH for SGLang's processes in `make test-sglang`: SGLang imports
torchvision at start-up (never calling it here), and PyPI's torchvision registers fake
kernels for operators its C extension cannot load beside the CPU torch. An empty
`torchvision._meta_registrations` skips those registrations. Not part of the package."""

import sys
import types

sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))
