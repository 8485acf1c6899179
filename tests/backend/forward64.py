"""The independent oracle of the real-model tests: a float64 forward of the same weights
through plain transformers (no genlm_fast code), one context at a time, no cache."""

import torch


def load_ref64(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).double()
    return model.eval()


def logprobs64(model, ctx):
    """float64 next-token log-probabilities after ``ctx``."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ctx)]), logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits, dim=-1)
