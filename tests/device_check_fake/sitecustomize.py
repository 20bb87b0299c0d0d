"""A faked GPU for the dry run of bench/device_check.sh (tests/test_device_check.py): torch reports one CUDA
device of compute capability FAKE_GPU_CC (default 9.0) and no driver behind it. On PYTHONPATH when the fake
python runs a command."""

import os
import types

import torch

_major, _minor = (int(x) for x in os.environ.get("FAKE_GPU_CC", "9.0").split("."))
_props = types.SimpleNamespace(name="Faked H200", major=_major, minor=_minor, multi_processor_count=132,
                               total_memory=141 << 30, gcnArchName="", L2_cache_size=60 << 20)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_properties = lambda device=None: _props
torch.cuda.get_device_name = lambda device=None: _props.name
torch.cuda.get_device_capability = lambda device=None: (_major, _minor)
