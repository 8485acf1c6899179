"""Triton kernels of genlm_fast.

``trie_reduce`` holds the fused trie-reduction kernels (launched by
``genlm_fast.ops.triton_backend``); ``log_softmax_rows`` the engine-side capture of
log-probabilities into a slot buffer (launched by ``genlm_fast.ops.log_softmax``).
Importing this package imports nothing heavy; its modules need triton.
"""
