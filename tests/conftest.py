"""Test-wide settings: Triton kernels run under the CPU interpreter where there is no GPU
(compiled on a GPU), and nothing touches a model hub."""

import os

import torch  # (does not import triton)

# Both must be set before anything imports triton or huggingface_hub.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
