"""The independent oracle of the real-model tests: a float64 forward of the same weights
through plain transformers (no genlm_fast code), one context at a time, no cache."""

import torch

# A prompt longer than the fused forward takes (64 new tokens) in both SmolLM2's and Llama-3's
# tokenizers: what a real-model test runs through transformers' forward.
LONG_PROMPT = (
    "The committee met on a grey Tuesday to settle the budget for the coming year. After "
    "an hour of argument about the library's roof, the bridge over the river and the new "
    "school buses, the chair proposed that every department cut its spending by a tenth, "
    "except the hospital, whose costs had risen with the winter. Nobody agreed. The "
    "treasurer then read out the figures for the last five years, line by line, while the "
    "rain beat on the windows and the clock above the door ticked towards noon."
)


def load_ref64(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).double()
    return model.eval()


def logprobs64(model, ctx):
    """float64 next-token log-probabilities after ``ctx``."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ctx)]), logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits, dim=-1)
