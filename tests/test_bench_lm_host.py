"""``bench.lm_host`` end to end at a small size: both step paths run through
`AsyncTransformer._forward` with the stand-in forward, and the paged one leaves every
particle's context stored in its trie (the stand-in ran the real planning and commits)."""

from __future__ import annotations

import random

from bench import lm_host


def test_both_paths_run_their_real_host_work():
    model = lm_host.smollm2_shaped_model()
    tokenizer = lm_host.smollm2_tokenizer()
    prompt = list(range(100, 110))
    for path in lm_host.PATHS:
        lm = lm_host.make_lm(path, model, tokenizer, kv_tokens=4096)
        lm_host.prefill(lm, path, prompt, model)
        particles = [prompt + [7 + i] for i in range(4)]
        times = lm_host.run_steps(lm, particles, 5, random.Random(0))
        assert len(times) == 5 and all(t > 0 for t in times)
        trie = lm._kv_trie(None)
        for p in particles:  # every context a step ran is stored (its last token is new)
            assert trie.match(p[:-1])[0] == len(p) - 1
        lm.cleanup()
    text = lm_host.report(
        {p: {"mean_ms": 1.0, "median_ms": 1.0} for p in lm_host.PATHS}, 4, 5, 1, 10
    )
    assert "| paged |" in text and "buckets / paged: 1.0x" in text
