"""`AsyncTransformer`: a Hugging Face causal LM behind the auto-batching `AsyncLM` API.

Beyond genlm.backend's AsyncTransformer, every evaluated context leaves its key/value
states in a per-adapter `KVTrie`, so a later query that extends it (the usual case in
sequential Monte Carlo: each particle adds one token per step) runs the model on the
new tokens only. Logits are computed for the last position of each context only.
"""

from __future__ import annotations

import inspect
import warnings
import weakref

import torch

from genlm_fast.backend.cache import kv_bytes_per_position, trim_heap
from genlm_fast.backend.llm import loader
from genlm_fast.backend.llm import threads as cpu_threads
from genlm_fast.backend.llm.batched import BatchedAsyncLM
from genlm_fast.backend.llm.cache_view import GenlmCacheTrie
from genlm_fast.backend.llm.checks import (
    check_byte_budget,
    check_finite_logits,
    learned_position_limit,
    unknown_lora,
)
from genlm_fast.backend.llm.engines import Forwards
from genlm_fast.backend.llm.model_state import ModelState

__all__ = ["AsyncTransformer"]


def _require_peft():
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ImportError(
            "LoRA adapters need the 'peft' package: `pip install peft` "
            "(it must match your transformers version)"
        ) from None


class AsyncTransformer(GenlmCacheTrie, BatchedAsyncLM):
    """Asynchronous, auto-batched, cached next-token distributions from a HF model.

    Args:
        hf_model: A Hugging Face causal LM (``AutoModelForCausalLM``).
        hf_tokenizer: Its tokenizer.
        batch_size (int, optional): Waiting queries that make a batch full (identical
            ones counted each time, as in genlm); also the most distinct contexts per
            forward pass. Defaults to 20.
        timeout (float, optional): Seconds after the first waiting query before a batch
            that is not full runs anyway. Defaults to 0.02.
        cache_size (int, optional): Rows kept in the LRU output cache. Defaults to 1024.
        kv_cache_tokens (int, optional): Positions of key/value states kept for reuse,
            per adapter; 0 disables KV reuse. Defaults to 16384. (A forward that reuses
            them assembles them in a buffer, kept for the next forward when it is at most
            64 MB; `clear_kv_cache` frees it too.) A position costs `kv_bytes_per_token`
            bytes (SmolLM2-135M in float32: 46,080, so 16384 positions are 755 MB; an 8B
            Llama-3 in float32: 262,144, 4.3 GB); ``genlm-fast info --model NAME`` says
            what it is for a model before loading it.
        kv_cache_bytes (int, optional): Bytes of key/value states kept for reuse, per
            adapter, on top of ``kv_cache_tokens``: the least recently used states are
            evicted as soon as either is exceeded; 0 disables KV reuse. Defaults to None
            (the positions' budget alone).
        flush_when_idle (bool, optional): Also run a batch that is not full as soon as the
            event loop has nothing else to run, instead of sitting out the rest of
            ``timeout`` (see `BatchedAsyncLM`). Defaults to True.
        follow_contention (bool, optional): On the CPU, before each forward pass, set
            torch's threads in the calling thread to the CPUs other processes leave free,
            at most your own setting (`genlm_fast.backend.llm.threads`); False leaves
            torch's setting alone. Defaults to True.
        cuda_graphs (bool, optional): On a CUDA device, run batches whose rows each add one
            token to a stored past (the steps of SMC and beams) from fixed-shape buckets
            replayed as CUDA graphs (`genlm_fast.backend.llm.graphs`): a small model's
            eager forward waits on the host's kernel launches. Results agree with the eager
            forward to rounding. The buckets' buffers (at most 1 GiB) stay across
            `clear_cache` and go with `cleanup` or a change of weights. Models with
            sliding-window or hybrid attention, and forwards that cannot be recorded, run
            eagerly. Defaults to None: on for a model on a CUDA device where it applies;
            True insists (an error on another device, a warning where it does not apply),
            False turns it off.
        paged_kv (bool, optional): Keep the key/value states in a paged pool on the model's
            device (blocks of `paged_forward.PagedEngine.PAGE` positions, ``kv_cache_tokens`` /
            ``kv_cache_bytes`` of them, allocated once) and run every forward over it with an
            attention that reads each row's past in place, through its block table
            (`genlm_fast.backend.llm.paged_kv`, `genlm_fast.ops.paged_attention`); on a
            CUDA device one-token steps replay CUDA graphs over block tables
            (`genlm_fast.backend.llm.paged_forward`). Rows sharing a prefix share its
            blocks. A batch whose pasts and new positions the pool cannot hold, even after
            evicting the least recently used blocks no row of it reads, raises
            `PagedPoolFull`, naming the budget. Off by default: it replaces the fused CPU
            decoder and the CUDA-graph buckets of ``cuda_graphs`` for this model. Models
            with cross-attention or per-layer rescaled scores are refused (ValueError).
        cpu_linear (str, optional): The kernel of the linear layers of transformers' forward
            on the CPU, where the fused decoder does not run (`cpu_linear.choose_kernel`:
            ``"auto"``, ``"avx512"``, ``"rows"`` or ``"torch"`` for torch's own layers).
            Defaults to "auto".

    On a CPU with AVX-512, a float32, bfloat16 or float16 model of a family the fused decoder
    knows (Llama and SmolLM, Mistral, Qwen2, Qwen3, Gemma, Gemma2, GPT-2) runs its forwards of up to
    `decoder.FusedEngine.MAX_TOKENS` new tokens as one compiled call on packed copies of its weights
    (`genlm_fast.backend.llm.decoder`), reading and writing the cached keys and values in
    place; longer prefills, peft adapters and other models run transformers' forward, on
    CPU linear layers over prepacked weights (`genlm_fast.backend.llm.cpu_linear`). On the
    CPU, a bfloat16 or float16 model computes in float32 either way, on its weights as stored
    (`genlm_fast.backend.llm.widen`). `forward_path` says which applies. Either way the
    copies are kept until `cleanup`, and a forward that finds the model changed (a parameter
    replaced or edited, an adapter injected) repacks them and forgets the cached keys, values
    and log-probabilities computed before (`reload_weights` for the edits it cannot see); a
    query answered from the output cache runs no forward, so call `clear_cache` too after
    editing weights.

    Raises (from the query methods):
        ValueError: a context longer than a model with learned position embeddings has
            positions for (GPT-2's 1024).
        NonFiniteLogitsError: the model's logits hold NaN or +inf.
    """

    @classmethod
    def from_name(cls, model_id, bitsandbytes_opts=None, hf_opts=None, **kwargs):
        """Load a model and tokenizer with ``from_pretrained`` and wrap them.

        ``model_id`` may be a local directory, a Hub id (cached locally when offline),
        or ``"smollm2"`` for the SmolLM2-135M-Instruct copy prepared by
        `genlm_fast.models.smollm2_path`.

        Args:
            model_id (str): Model name or path.
            bitsandbytes_opts (dict, optional): Options of a ``BitsAndBytesConfig``.
            hf_opts (dict, optional): Extra ``from_pretrained`` options; by default
                ``device_map="auto"`` and ``dtype="auto"``.
            **kwargs: Passed to the `AsyncTransformer` constructor.

        Raises:
            FileNotFoundError: The model could not be found (not a directory, and not
                available from the Hub or its local cache).
        """
        model, tokenizer = loader.load(model_id, bitsandbytes_opts, hf_opts)
        return cls(model, tokenizer, **kwargs)

    def __init__(
        self,
        hf_model,
        hf_tokenizer,
        batch_size=20,
        timeout=0.02,
        cache_size=1024,
        kv_cache_tokens=16384,
        flush_when_idle=True,
        follow_contention=True,
        kv_cache_bytes=None,
        cuda_graphs=None,
        paged_kv=False,
        cpu_linear="auto",
    ):
        self.model = hf_model
        self.model.eval()
        self.follow_contention = bool(follow_contention)
        self._state, self._packed_linears = ModelState.attach(hf_model, cpu_linear)
        self._generation = self._state.generation
        super().__init__(
            hf_tokenizer,
            batch_size=batch_size,
            timeout=timeout,
            cache_size=cache_size,
            flush_when_idle=flush_when_idle,
        )
        self._device = hf_model.device
        emb = hf_model.get_input_embeddings()
        self._n_embed = int(
            emb.num_embeddings if hasattr(emb, "num_embeddings") else emb.weight.shape[0]
        )
        pad = getattr(hf_tokenizer, "pad_token_id", None)
        self._pad_id = pad if pad is not None and 0 <= pad < self._n_embed else 0
        self.kv_cache_tokens = int(kv_cache_tokens)
        self.kv_cache_bytes = check_byte_budget(kv_cache_bytes)
        self._kv_on = self.kv_cache_tokens > 0 and self.kv_cache_bytes != 0
        self._kv_tries = {}
        self._walked_pasts = weakref.WeakKeyDictionary()  # see GenlmCacheTrie.walk_cache
        self._position_limit = learned_position_limit(hf_model)
        try:
            self._forwards = Forwards.choose(
                hf_model,
                self._state,
                pad_id=self._pad_id,
                keeps_logits="logits_to_keep" in inspect.signature(hf_model.forward).parameters,
                kv_on=self._kv_on,
                paged_kv=paged_kv,
                cuda_graphs=cuda_graphs,
            )
        except BaseException:  # options refused: the model is not ours to keep
            self._state.detach(hf_model, self._packed_linears)
            raise

    # ---- basics --------------------------------------------------------------------

    @property
    def device(self):
        return self._device

    @property
    def forward_path(self):
        """Which engine runs the base model's decoding steps (`engines.Forwards.path`):
        ``"fused"`` (one compiled call, `genlm_fast.backend.llm.decoder`), ``"paged (...)"``
        or ``"transformers (<why not fused>)"``, with CUDA graphs where they replay steps."""
        if self._state is None:
            return "closed"
        return self._forwards.path

    def settle(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for what loading left running in the background
        (the fused decoder's packed weights being gathered into 2 MB pages on idle CPUs,
        `packed_pages`) to end; True once it has (or there was none). Steps run before
        that are somewhat slower: time the steady state after it."""
        state = self._state
        decoder = state.decoder if state is not None else None
        if decoder is None or decoder.huge_pages is None:
            return True
        return decoder.huge_pages.wait(timeout)

    def _vocab_limit(self):
        return self._n_embed

    def _size_threads(self):
        if self.follow_contention and self._device.type == "cpu":
            cpu_threads.follow_contention()

    def _check_context(self, token_ids):
        ids = super()._check_context(token_ids)
        if self._position_limit is not None and len(ids) > self._position_limit:
            raise ValueError(
                f"context of {len(ids)} tokens is longer than the {self._position_limit} "
                f"positions of {type(self.model).__name__}'s position embedding"
            )
        return ids

    def _release(self):
        if self.follow_contention:
            cpu_threads.restore_threads()
        self._drop_kv()
        self._kv_tries = {}
        self._forwards = None
        model, self.model = self.model, None
        state, self._state = self._state, None
        state.detach(model, self._packed_linears)
        del model
        import gc

        gc.collect()
        trim_heap()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def clear_cache(self):
        """Forget cached log probabilities and key/value states, and give their memory
        back."""
        self._drop_kv()
        super().clear_cache()

    def clear_kv_cache(self):
        """Forget cached key/value states (log probabilities stay cached), and give their
        memory back."""
        self._drop_kv()
        trim_heap()

    def _drop_kv(self):
        forwards = self._forwards
        if forwards is not None:
            forwards.eager.kv_buffer = None
        for trie in self._kv_tries.values():
            trie.clear()
        if forwards is None or forwards.paged is None:
            self._kv_tries = {}
        # (a paged trie keeps its pool: its blocks are free again, and the recorded steps
        # still write to its memory)

    def reload_weights(self):
        """Say that the model's weights changed: the next forward packs them again (the fused
        decoder's copies and the CPU linear layers') and forgets the key/value states and
        log-probabilities computed before, for every AsyncTransformer over the model.

        Forwards notice most changes on their own (a parameter replaced, changed in place,
        or, on the CPU, edited through ``.data`` in a tensor of up to 4096 entries or all
        over a larger one, as a LoRA merge does); an edit through ``.data`` or numpy of a
        few entries of a larger weight, or of any weight on a GPU, is the one to announce
        this way."""
        self._check_open()
        with self._forward_lock:
            self._state.weights_changed()

    def _kv_trie(self, lora):
        trie = self._kv_tries.get(lora)
        if trie is None:
            trie = self._forwards.new_trie(self.kv_cache_tokens, self.kv_cache_bytes)
            self._kv_tries[lora] = trie
        return trie

    @property
    def kv_bytes_per_token(self):
        """Bytes of key/value states one cached position takes (from the model's config
        and dtype: layers x 2 x key/value heads x head size x element size; float32 where
        the model computes in float32, whatever its dtype)."""
        self._check_open()
        return kv_bytes_per_position(self.model.config, self._forwards.kv_dtype.itemsize)[0]

    def cache_kv(self, prompt_tokens, lora_name=None):
        """Run ``prompt_tokens`` now and keep its key/value states for later queries.

        As in genlm, the prompt becomes a fresh entry of the cache: what was cached for
        longer contexts that extend it (states, log probabilities) is forgotten (see
        `walk_cache`)."""
        lora, ids = self._prepare(prompt_tokens, lora_name)
        n = len(ids)
        with self._lock:
            self._outputs.discard_where(
                lambda key: key[0] == lora and len(key[1]) > n and key[1][:n] == ids
            )
        if self._kv_on:
            with self._forward_lock:
                self._kv_trie(lora).drop_extensions(ids)
        self._evaluate(lora, [ids])

    # ---- LoRA ----------------------------------------------------------------------

    def _loaded_adapters(self):
        if self.model is None or not getattr(self.model, "_hf_peft_config_loaded", False):
            return set()
        return set(getattr(self.model, "peft_config", {}) or {})

    def _resolve_lora(self, lora_name):
        if lora_name is None:
            lora_name = self._active_lora
            if lora_name is None:
                return None
        if lora_name not in self._loaded_adapters():
            raise unknown_lora(lora_name)
        return lora_name

    def add_new_lora(self, lora_path, lora_name="lora_1"):
        """Load a LoRA adapter (a PEFT directory or Hub id) under ``lora_name``.

        Loading under a name already in use replaces that adapter. The adapter is used
        by calls that pass ``lora_name=...``, or by all calls after `set_lora`.
        """
        self._check_open()
        _require_peft()
        default = self._active_lora
        if lora_name in self._loaded_adapters():
            self.remove_lora(lora_name)
        self.model.load_adapter(lora_path, adapter_name=lora_name)
        self._state.rebuild(self.model, forget=False)
        self._forget_adapter(lora_name)
        self._active_lora = default  # replacing the default adapter keeps it the default

    def remove_lora(self, lora_name):
        """Unload an adapter and its caches."""
        self._check_open()
        if lora_name not in self._loaded_adapters():
            raise unknown_lora(lora_name)
        self.model.delete_adapter(lora_name)
        self._state.rebuild(self.model, forget=False)
        self._forget_adapter(lora_name)
        if self._active_lora == lora_name:
            self._active_lora = None

    def set_lora(self, lora_path=None, lora_name="lora_1"):
        """Use the loaded adapter ``lora_name`` for calls that pass no ``lora_name``.

        Raises:
            UnknownLoraError: (a ValueError) if it was not loaded with `add_new_lora`.
        """
        self._check_open()
        if lora_name not in self._loaded_adapters():
            raise unknown_lora(lora_name)
        self._active_lora = lora_name

    def clear_lora(self):
        """Use the base model for calls that pass no ``lora_name``."""
        self._check_open()
        self._active_lora = None

    def _forget_adapter(self, lora_name):
        """Drop what was computed with adapter ``lora_name``, loaded or removed, and the
        recorded forwards, recorded over the model's layers before that change."""
        trie = self._kv_tries.pop(lora_name, None)
        if trie is not None:
            trie.clear()
        with self._lock:
            self._outputs.discard_where(lambda key: key[0] == lora_name)
        self._forwards.clear()

    def _activate(self, lora):
        # Set on every batch, never remembered: the model may be shared with another
        # AsyncTransformer, and load_adapter or the caller may change its adapters.
        if lora is None:
            if getattr(self.model, "_hf_peft_config_loaded", False):
                self.model.disable_adapters()
        else:
            if lora not in self._loaded_adapters():
                raise unknown_lora(lora)
            self.model.set_adapter(lora)
            self.model.enable_adapters()

    # ---- the forward pass ----------------------------------------------------------

    def _sync_with_model(self):
        """Rebuild what was derived from the model's weights if it changed, and forget the
        key/value states and log-probabilities computed before."""
        state = self._state
        state.sync(self.model)
        if state.generation != self._generation:
            self._generation = state.generation
            self.clear_kv_cache()
            self._forwards.clear()  # recorded over parameters that may be gone
            with self._lock:
                self._outputs.clear()

    @torch.no_grad()
    def _forward(self, lora, rows):
        self._sync_with_model()
        self._activate(lora)
        trie = self._kv_trie(lora) if self._kv_on else None
        logits, kept = self._forwards.run(lora, rows, trie)
        if not kept:
            warnings.warn(
                f"{type(self.model).__name__} returned a key/value cache this backend cannot "
                "reuse; key/value reuse is disabled (results are unaffected)",
                RuntimeWarning,
                stacklevel=2,
            )
            self._kv_on = False
            self.clear_kv_cache()
        return logits

    # ---- genlm.backend extras --------------------------------------------------------

    @torch.no_grad()
    def next_token_logprobs_uncached(self, token_ids, lora_name=None):
        """Log probabilities from one forward pass over the whole context, bypassing every
        cache: the fused decoder's where it would run the context's tokens in one forward
        (so a cached query's answer is this one, bit for bit), else transformers'."""
        lora, ids = self._prepare(token_ids, lora_name)
        self._sync_with_model()
        self._activate(lora)
        logits = self._forwards.uncached(lora, ids)
        check_finite_logits(logits[None], [ids])
        return torch.log_softmax(logits.float(), dim=-1).cpu()
