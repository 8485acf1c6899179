"""Tiny seeded random models of each family the fused CPU decoder knows (built from a config,
nothing downloaded), their float64 oracle (transformers' forward of a float64 copy over whole
contexts, no cache) and SMC/beam-like decoding rounds: shared by test_decoder.py and
test_decoder_weight_edits.py."""

from __future__ import annotations

import copy

import torch

V = 49157  # the SmolLM2 tokenizer's 49152 tokens and a few more: the LM head has a ragged panel
ATOL = 2e-4  # float32 against float64 log-probabilities, on models this small


def tiny_config(family):
    import transformers as tf

    # head sizes that are and are not multiples of 16, biases, norms of every kind
    common = {
        "vocab_size": V,
        "num_hidden_layers": 2,
        "max_position_embeddings": 64,
        "initializer_range": 0.3,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if family == "llama":
        return tf.LlamaConfig(
            **common,
            hidden_size=40,
            intermediate_size=72,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    if family == "llama-yarn":  # a rope variant that scales cos and sin
        return tf.LlamaConfig(
            **common,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 16,
            },
        )
    if family == "mistral":
        return tf.MistralConfig(
            **common,
            hidden_size=64,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            sliding_window=6,
        )
    if family == "qwen2":
        return tf.Qwen2Config(
            **common,
            hidden_size=48,
            intermediate_size=64,
            num_attention_heads=3,
            num_key_value_heads=1,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            tie_word_embeddings=False,
        )
    if family == "qwen3":
        return tf.Qwen3Config(
            **common,
            hidden_size=32,
            intermediate_size=64,
            head_dim=24,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    if family == "gemma":
        return tf.GemmaConfig(
            **common,
            hidden_size=48,
            intermediate_size=64,
            head_dim=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            hidden_activation="gelu_pytorch_tanh",
        )
    if family == "gemma2":
        return tf.Gemma2Config(
            **common,
            hidden_size=48,
            intermediate_size=64,
            head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        )
    if family == "gpt2":
        return tf.GPT2Config(
            vocab_size=V,
            n_embd=48,
            n_layer=2,
            n_head=3,
            n_positions=40,
            initializer_range=0.3,
            bos_token_id=1,
            eos_token_id=2,
        )
    raise ValueError(family)


FAMILIES = ["llama", "llama-yarn", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2"]


def tiny_model(family, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    with torch.no_grad():  # norms away from their initial ones and zeros
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


class Oracle:
    """transformers' float64 forward of a copy of the model, over whole contexts."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).double().eval()

    def __call__(self, ctx):
        with torch.no_grad():
            logits = self.model(torch.tensor([list(ctx)])).logits[0, -1]
        return torch.log_softmax(logits, -1)


def assert_matches(rows, ctxs, oracle, atol=ATOL):
    for row, ctx in zip(rows, ctxs):
        want = oracle(ctx)
        err = (row.double() - want).abs().max().item()
        assert err < atol, f"context of {len(ctx)} tokens: max |error| {err:.2e}"


def spy_fused(lm):
    """Record (past, new) of every row the fused decoder runs."""
    seen = []
    engine = lm._forwards.fused
    run = engine.run

    def spy(rows, keep):
        seen.extend((row.depth, row.new) for row in rows)
        return run(rows, keep)

    engine.run = spy
    return seen


def rounds(rng, B, prompt_lengths):
    """Contexts of SMC/beam-like decoding: prompts of different lengths (sharing a prefix),
    then rounds that add 1 or 2 tokens to every row, resample rows and branch."""
    shared = [rng.randrange(3, V - 5) for _ in range(3)]
    rows = [
        shared + [rng.randrange(3, 49000) for _ in range(rng.choice(prompt_lengths))]
        for _ in range(B)
    ]
    out = [[list(r) for r in rows]]
    for step in range(4):
        grow = 1 if step % 2 == 0 else 2
        rows = [r + [rng.randrange(3, 49000) for _ in range(grow)] for r in rows]
        out.append([list(r) for r in rows])
        rows = [list(rng.choice(rows)) for _ in range(B)]  # resample: shared pasts, duplicates
    return out
