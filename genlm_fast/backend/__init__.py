"""genlm.backend-compatible API: vocabulary decoding and tries."""
