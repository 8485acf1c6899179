"""Triton kernels of genlm_fast (installed as the subpackage ``genlm_fast.kernels``).

``trie_reduce`` holds the fused trie-reduction kernels; the backend wrapper that launches
them is ``genlm_fast.ops.triton_backend``. Importing this package imports nothing heavy;
importing ``genlm_fast.kernels.trie_reduce`` needs triton.
"""
