"""A LoRA adapter for SmolLM2, made locally with peft (nothing downloaded)."""

from __future__ import annotations

import torch


def make_lora_adapter(model_dir, out_dir, contexts=()):
    """Save a randomly initialised LoRA adapter (q_proj, v_proj; seed 0) for the model in
    ``model_dir`` to ``out_dir``; returns peft's own next-token log-probs for ``contexts``."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft_model = peft.get_peft_model(base, config).eval()
    peft_model.save_pretrained(out_dir)
    with torch.no_grad():
        return [
            torch.log_softmax(peft_model(torch.tensor([c])).logits[0, -1], -1) for c in contexts
        ]
