"""Test-wide settings: run Triton kernels under the CPU interpreter, never touch a model hub."""

import os

# Both must be set before anything imports triton or huggingface_hub.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
