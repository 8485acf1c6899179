"""The GPU tools' tests run on CPU here: the Triton kernels under the interpreter (set before
anything imports triton), and nothing touches a model hub."""

import os

import torch  # (does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
