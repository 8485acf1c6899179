"""`AsyncTransformer`: a Hugging Face causal LM behind the auto-batching `AsyncLM` API.

Beyond genlm.backend's AsyncTransformer, every evaluated context leaves its key/value
states in a per-adapter `KVTrie`, so a later query that extends it (the usual case in
sequential Monte Carlo: each particle adds one token per step) runs the model on the
new tokens only. Logits are computed for the last position of each context only.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import warnings
import weakref

import torch

from genlm_fast.backend.cache import KVTrie, kv_bytes_per_position, trim_heap
from genlm_fast.backend.llm import threads as cpu_threads
from genlm_fast.backend.llm.batched import BatchedAsyncLM
from genlm_fast.backend.llm.cache_view import CacheNode, CacheTries, dynamic_cache, matched
from genlm_fast.backend.llm.checks import check_finite_logits, unknown_lora
from genlm_fast.backend.llm.cpu_linear import pack_linear_layers, unpack_linear_layers
from genlm_fast.backend.llm.decoder import FusedDecoder, ModelWatch, Unsupported
from genlm_fast.backend.llm.graphs import CaptureFailed, DecodeGraphs, graphs_unsupported
from genlm_fast.backend.llm.kv_buffer import buffer_cache, buffer_layer_class, copy_pasts
from genlm_fast.backend.llm.paged_forward import PagedForward, paged_unsupported
from genlm_fast.backend.llm.paged_kv import PagedKVPool, PagedKVTrie

__all__ = ["AsyncTransformer"]

# how many open AsyncTransformers packed each model's linear layers: the last one to close
# gives the model its own layers back (one closing must not unpack another's model)
_packers = weakref.WeakKeyDictionary()


class _ModelState:
    """What the AsyncTransformers over one model share: its fused decoder (or why there is
    none) and the watch that notices the model changing. ``generation`` counts the changes
    seen, so that each AsyncTransformer drops the caches it computed before one."""

    def __init__(self, model):
        self.users = 0
        self.generation = 0
        self.rebuild(model, forget=False)

    def rebuild(self, model, forget=True):
        """Read the model again; ``forget``: its answers may have changed, so the caches
        computed before go too (not for an adapter loaded through `AsyncTransformer`, which
        leaves the base model's answers as they were)."""
        self.stale = False
        self.decoder = None  # the old packed copies go before new ones are made
        try:
            self.decoder, self.reason = FusedDecoder(model), None
        except Unsupported as exc:
            self.reason = str(exc)
        self.watch = ModelWatch(model)
        if forget:
            self.generation += 1

    def sync(self, model):
        """Rebuild the decoder if the model changed since it was built (or was said to)."""
        if self.stale or self.watch.changed():
            self.rebuild(model)


# each model's _ModelState, while an open AsyncTransformer uses it
_states = weakref.WeakKeyDictionary()


def _require_peft():
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ImportError(
            "LoRA adapters need the 'peft' package: `pip install peft` "
            "(it must match your transformers version)"
        ) from None


class AsyncTransformer(BatchedAsyncLM):
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
            device (blocks of `PAGE` positions, ``kv_cache_tokens`` / ``kv_cache_bytes`` of
            them, allocated once) and run every forward over it with an attention that
            reads each row's past in place, through its block table
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
            ``"auto"``, ``"avx512"``, ``"onednn"`` or ``"torch"`` for torch's own layers).
            Defaults to "auto".

    On a CPU with AVX-512, a float32, bfloat16 or float16 model of a family the fused decoder
    knows (Llama and SmolLM, Mistral, Qwen2, Qwen3, Gemma, Gemma2, GPT-2) runs its forwards of up to
    `FUSED_MAX_TOKENS` new tokens as one compiled call on packed copies of its weights
    (`genlm_fast.backend.llm.decoder`), reading and writing the cached keys and values in
    place; longer prefills, peft adapters and other models run transformers' forward, on
    CPU linear layers over prepacked weights (`genlm_fast.backend.llm.cpu_linear`).
    `forward_path` says which applies. Either way the copies are kept until `cleanup`, and
    a forward that finds the model changed (a parameter replaced or edited, an adapter
    injected) repacks them and forgets the cached keys, values and log-probabilities
    computed before (`reload_weights` for the edits it cannot see); a query answered from the
    output cache runs no forward, so call `clear_cache` too after editing weights.

    Raises (from the query methods):
        ValueError: a context longer than a model with learned position embeddings has
            positions for (GPT-2's 1024).
        NonFiniteLogitsError: the model's logits hold NaN or +inf.
    """

    # the most new tokens one fused forward takes; rows of more go to transformers' forward
    FUSED_MAX_TOKENS = 64
    # positions per block of the paged key/value pool (``paged_kv=True``)
    PAGE = 16

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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from genlm_fast.models import resolve_model_name

        model_id = resolve_model_name(model_id)
        opts = {"device_map": "auto", "dtype": "auto"}
        if hf_opts:
            if "torch_dtype" in hf_opts:
                opts.pop("dtype")
            opts.update(hf_opts)
        if opts.get("device_map") == "auto":
            import importlib.util

            if importlib.util.find_spec("accelerate") is None:
                opts.pop("device_map")
        if bitsandbytes_opts:
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)

        if isinstance(model_id, str) and _is_missing_path(model_id):
            raise FileNotFoundError(f"model directory {model_id!r} does not exist")
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_id)
        except (OSError, ValueError) as exc:
            if isinstance(model_id, str) and os.path.isdir(model_id):
                if not any(
                    os.path.exists(os.path.join(model_id, name)) for name in _TOKENIZER_FILES
                ):
                    raise FileNotFoundError(
                        f"model directory {model_id!r} has no tokenizer (none of "
                        f"{', '.join(_TOKENIZER_FILES)}): save the tokenizer beside the "
                        "model, e.g. tokenizer.save_pretrained(path)"
                    ) from exc
                raise  # found, but unreadable: transformers' own message says why
            offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
            where = " (HF_HUB_OFFLINE is set, so only local files are used)" if offline else ""
            raise FileNotFoundError(
                f"could not load model {model_id!r}: it is not a local model directory and "
                f"was not found on the Hugging Face Hub or in its cache{where}"
            ) from exc
        model = AutoModelForCausalLM.from_pretrained(model_id, **opts)
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
        state = _states.get(hf_model)
        if state is None:
            state = _states[hf_model] = _ModelState(hf_model)
        state.users += 1
        self._state, self._generation = state, state.generation
        # the fused decoder has its own packed copies; transformers' forward then runs only
        # long prefills and adapters, on torch's own layers
        self._packed_linears = (
            0 if state.decoder is not None else pack_linear_layers(hf_model, cpu_linear)
        )
        if self._packed_linears:
            _packers[hf_model] = _packers.get(hf_model, 0) + 1
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
        self.kv_cache_bytes = _byte_budget(kv_cache_bytes)
        self._kv_on = self.kv_cache_tokens > 0 and self.kv_cache_bytes != 0
        self._kv_tries = {}
        self._kv_buffer = None  # flat storage of the last forward's KV, see _run
        self._walked_pasts = weakref.WeakKeyDictionary()  # walk_cache's pasts -> their prefix
        params = inspect.signature(hf_model.forward).parameters
        self._keeps_logits = "logits_to_keep" in params
        self._position_limit = _learned_position_limit(hf_model)
        self._paged = self._paged_forward(paged_kv)
        self._graphs = None if self._paged is not None else self._decode_graphs(cuda_graphs)

    def _paged_forward(self, wanted):
        """The `PagedForward` of ``paged_kv``, or None."""
        if not isinstance(wanted, bool):
            raise TypeError(f"paged_kv must be True or False, got {wanted!r}")
        if not wanted:
            return None
        why_not = paged_unsupported(self.model)
        if why_not is not None:
            raise ValueError(f"paged_kv=True cannot run {type(self.model).__name__}: {why_not}")
        if not self._kv_on:
            raise ValueError(
                "paged_kv=True keeps every forward's states in the pool: kv_cache_tokens and "
                "kv_cache_bytes must leave room for some (got 0)"
            )
        return PagedForward(self.model, self._keeps_logits, capture=self._device.type == "cuda")

    def _new_pool(self):
        """A `PagedKVPool` for one adapter's trie, as large as the key/value budget."""
        dtype = self.model.dtype
        per_position = kv_bytes_per_position(self.model.config, dtype.itemsize)[0]
        positions = self.kv_cache_tokens
        if self.kv_cache_bytes is not None:
            positions = min(positions, self.kv_cache_bytes // per_position)
        config = self.model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        )
        return PagedKVPool(
            int(text.num_hidden_layers),
            heads,
            head_dim,
            dtype,
            self._device,
            blocks=positions // self.PAGE + 1,
            page=self.PAGE,
        )

    def _decode_graphs(self, wanted):
        """The `DecodeGraphs` of ``cuda_graphs`` (None: where they apply), or None."""
        if wanted is not None and not isinstance(wanted, bool):
            raise TypeError(f"cuda_graphs must be None, True or False, got {wanted!r}")
        if wanted is False:
            return None
        if self._device.type != "cuda":
            if wanted:
                raise ValueError(
                    "cuda_graphs=True needs a model on a CUDA device; this one is on "
                    f"{self._device}"
                )
            return None
        why_not = graphs_unsupported(self.model)
        if why_not is not None:
            if wanted:
                warnings.warn(
                    f"cuda_graphs: {type(self.model).__name__} keeps the eager forward: {why_not}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        return DecodeGraphs(self.model, self._keeps_logits)

    # ---- basics --------------------------------------------------------------------

    @property
    def device(self):
        return self._device

    @property
    def forward_path(self):
        """Which forward runs the base model's decoding steps: ``"fused"`` (one compiled call,
        `genlm_fast.backend.llm.decoder`) or ``"transformers (<why not fused>)"``."""
        state = self._state
        if state is None:
            return "closed"
        if self._paged is not None:
            graphs = ", one-token steps as CUDA graphs" if self._paged.capture else ""
            return f"paged (attention over a paged key/value pool{graphs})"
        if state.decoder is not None:
            return "fused"
        graphs = ", one-token steps as CUDA graphs" if self._graphs is not None else ""
        return f"transformers ({state.reason}){graphs}"

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
        self._graphs = self._paged = None
        model, self.model = self.model, None
        state, self._state = self._state, None
        state.users -= 1
        if state.users == 0 and _states.get(model) is state:
            del _states[model]  # its packed copies go with it
        if self._packed_linears:
            _packers[model] = left = _packers.get(model, 1) - 1
            if left == 0:  # the caller's model gets its own layers back
                del _packers[model]
                unpack_linear_layers(model)
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
        self._kv_buffer = None
        for trie in self._kv_tries.values():
            trie.clear()
        if self._paged is None:
            self._kv_tries = {}
        # (a paged trie keeps its pool: its blocks are free again, and the recorded steps
        # still write to its memory)

    def reload_weights(self):
        """Say that the model's weights changed: the next forward packs them again and
        forgets the key/value states and log-probabilities computed before.

        Forwards notice most changes on their own (a parameter replaced, changed in place,
        or, on the CPU, edited through ``.data`` in a tensor of up to 4096 entries or all
        over a larger one, as a LoRA merge does); an edit through ``.data`` or numpy of a
        few entries of a larger weight, or of any weight on a GPU, is the one to announce
        this way."""
        self._check_open()
        with self._forward_lock:
            self._state.stale = True

    def _kv_trie(self, lora):
        trie = self._kv_tries.get(lora)
        if trie is None:
            if self._paged is not None:
                trie = PagedKVTrie(self._new_pool())
            else:
                trie = KVTrie(self.kv_cache_tokens, self.kv_cache_bytes)
            self._kv_tries[lora] = trie
        return trie

    @property
    def kv_bytes_per_token(self):
        """Bytes of key/value states one cached position takes (from the model's config
        and dtype: layers x 2 x key/value heads x head size x element size; float32 where
        the fused decoder runs, whatever the model's dtype)."""
        self._check_open()
        return kv_bytes_per_position(self.model.config, self._kv_dtype.itemsize)[0]

    @property
    def _kv_dtype(self):
        """The dtype of the stored key/value states: float32 where the fused decoder runs
        (its own states, and a 16-bit model's prefills widened for it to read in place, not
        converted again on every read), else the model's."""
        fused = self._state.decoder is not None and self._paged is None
        return torch.float32 if fused else self.model.dtype

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
        if self._graphs is not None:
            self._graphs.clear()
        if self._paged is not None:
            self._paged.clear()

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
            if self._graphs is not None:  # recorded over parameters that may be gone
                self._graphs.clear()
            if self._paged is not None:
                self._paged.clear()
            with self._lock:
                self._outputs.clear()

    @torch.no_grad()
    def _forward(self, lora, rows):
        self._sync_with_model()
        self._activate(lora)
        if self._paged is not None:
            return self._run_paged(lora, rows)
        trie = self._kv_trie(lora) if self._kv_on else None
        plans = []
        for ids in rows:
            if trie is not None:
                depth, runs = trie.match(ids, len(ids) - 1)
            else:
                depth, runs = 0, []
            plans.append((ids, depth, runs))
        decoder = self._state.decoder if lora is None else None
        if decoder is None:
            chunks, fused = self._split(plans), []
        else:
            fused, rest = self._fused_chunks(plans)
            chunks = self._split([plans[i] for i in rest]) if rest else []
            chunks = [[rest[i] for i in chunk] for chunk in chunks]
        jobs = [(chunk, True) for chunk in fused] + [(chunk, False) for chunk in chunks]
        graphs = lora is None  # adapters run eagerly
        if len(jobs) == 1:
            chunk, is_fused = jobs[0]
            if is_fused:
                return self._run_fused(decoder, plans, trie)
            return self._run(plans, trie, graphs)
        out = None
        for chunk, is_fused in jobs:
            part = [plans[i] for i in chunk]
            if is_fused:
                logits = self._run_fused(decoder, part, trie)
            else:
                logits = self._run(part, trie, graphs)
            if out is None:
                out = logits.new_empty((len(rows), logits.shape[1]))
            out[torch.tensor(chunk, device=logits.device)] = logits
        return out

    def _run_paged(self, lora, rows):
        """One forward over the adapter's paged pool: plan it (slots, copies), run it,
        then keep its states, or give its blocks back if it failed."""
        trie = self._kv_trie(lora)
        plan = trie.plan(rows)
        try:
            # recorded steps are the base model's: an adapter's forwards run eagerly
            logits = self._paged.run(plan, trie.pool, self._pad_id, buckets=lora is None)
            check_finite_logits(logits, rows)
        except CaptureFailed as exc:
            trie.release_plan(plan)
            warnings.warn(
                f"paged_kv: {type(self.model).__name__}'s step could not be recorded as a "
                f"CUDA graph, so it runs eagerly ({exc})",
                RuntimeWarning,
                stacklevel=3,
            )
            self._paged.capture = False
            return self._run_paged(lora, rows)
        except BaseException:
            trie.release_plan(plan)
            raise
        trie.commit(plan)
        return logits

    def _fused_chunks(self, plans):
        """Rows for the fused decoder, in forwards of at most `FUSED_MAX_TOKENS` new tokens,
        and the rows with more (prefills, for transformers' forward)."""
        fused, rest, chunk, size = [], [], [], 0
        for i, (ids, d, _) in enumerate(plans):
            n = len(ids) - d
            if n > self.FUSED_MAX_TOKENS:
                rest.append(i)
                continue
            if size + n > self.FUSED_MAX_TOKENS:
                fused.append(chunk)
                chunk, size = [], 0
            chunk.append(i)
            size += n
        if chunk:
            fused.append(chunk)
        return fused, rest

    def _run_fused(self, decoder, plans, trie):
        """One fused forward; returns last-position logits ``[B, V]``, stores the new KV."""
        logits, segments = decoder.forward(plans)
        check_finite_logits(logits, [ids for ids, _, _ in plans])
        if trie is not None:
            for (ids, d, runs), seg in zip(plans, segments):
                trie.insert(ids, d, seg, runs)
        return logits

    # Cost model of one forward, in token-rows: a fixed overhead, plus the padded work,
    # which costs no less than reading the weights once (small batches are memory-bound).
    _FORWARD_OVERHEAD = 16
    _MEMORY_FLOOR = 64

    @classmethod
    def _split(cls, plans):
        """Partition rows into forwards so that right-padding does not dominate.

        Rows sorted by new-token count are cut into contiguous groups minimising
        ``sum(overhead + max(floor, rows * longest))`` (exact, by dynamic programming).
        """
        order = sorted(range(len(plans)), key=lambda i: -(len(plans[i][0]) - plans[i][1]))
        lengths = [len(plans[i][0]) - plans[i][1] for i in order]
        n = len(order)
        best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j rows
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):  # rows i..j-1 in one forward; the longest is row i
                cost = (
                    best[i] + cls._FORWARD_OVERHEAD + max(cls._MEMORY_FLOOR, (j - i) * lengths[i])
                )
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        chunks = []
        j = n
        while j > 0:
            chunks.append(sorted(order[cut[j] : j]))
            j = cut[j]
        return chunks[::-1]

    def _run(self, plans, trie, graphs=False):
        """One padded forward; returns last-position logits ``[B, V']``, stores new KV.
        With ``graphs`` (and `DecodeGraphs` on), rows that each add one token to a stored
        past run from a bucket."""
        if (
            graphs
            and self._graphs is not None
            and all(len(ids) - d == 1 and d for ids, d, _ in plans)
        ):
            try:
                done = self._graphs.run(plans, self._pad_id)
            except CaptureFailed as exc:
                warnings.warn(
                    f"cuda_graphs: {type(self.model).__name__}'s forward could not be "
                    f"recorded as a CUDA graph, so it runs eagerly ({exc})",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._graphs = done = None
            if done is not None:
                logits, kv, cache = done
                check_finite_logits(logits, [ids for ids, _, _ in plans])
                self._store_kv(trie, plans, [1] * len(plans), kv.shape[4] - 1, cache, kv)
                return logits
        dev = self._device
        B = len(plans)
        news = [len(ids) - d for ids, d, _ in plans]
        max_past = max(d for _, d, _ in plans)
        max_new = max(news)
        pad = self._pad_id
        input_ids, positions, mask = [], [], []
        # New tokens are left-padded, so every row's last token sits at position max_new - 1
        # and the LM head runs once per row (logits_to_keep=1), whatever the rows' lengths.
        for (ids, d, _), n in zip(plans, news):
            input_ids.append([pad] * (max_new - n) + list(ids[d:]))
            positions.append([0] * (max_new - n) + list(range(d, d + n)))
            mask.append([1] * d + [0] * (max_past - d) + [0] * (max_new - n) + [1] * n)
        kwargs = {
            "input_ids": torch.tensor(input_ids, device=dev),
            "attention_mask": torch.tensor(mask, device=dev),
            "position_ids": torch.tensor(positions, device=dev),
            "use_cache": trie is not None,
        }
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1
        if not max_past:
            out = self.model(**kwargs)
            check_finite_logits(out.logits[:, -1], [ids for ids, _, _ in plans])
            if trie is not None:
                self._store_kv(trie, plans, news, 0, out.past_key_values)
            return out.logits[:, -1]

        # The past and the new positions share one [L, 2, B, H, max_past + max_new, D]
        # buffer, reused from the last forward: the rows' stored KV is copied in once, the
        # model writes the new positions after it (_BufferLayer), and nothing is
        # concatenated or zero-filled but the gaps of rows with a shorter past (masked,
        # but they must be finite: 0 * NaN would poison the attention).
        # (in the model's dtype: a bfloat16 model's stored states are float32, the fused
        # decoder's, and copy_pasts converts)
        seg = next(runs[0][0] for _, d, runs in plans if d)
        L, _, H, _, D = seg.data.shape
        shape = (L, 2, B, H, max_past + max_new, D)
        storage = self._take_kv_buffer(shape, self.model.dtype, seg.data.device)
        try:
            kv = storage[: math.prod(shape)].view(shape)
            copy_pasts(kv, plans, max_past)
            kwargs["past_key_values"] = buffer_cache(kv, max_past)
            out = self.model(**kwargs)
            check_finite_logits(out.logits[:, -1], [ids for ids, _, _ in plans])
            # (a past came from the trie, so there is one)
            self._store_kv(trie, plans, news, max_past, out.past_key_values, kv)
        finally:
            self._give_back_kv_buffer(storage)
        return out.logits[:, -1]

    # A KV buffer up to this size is kept for the next forward: a fresh one would be
    # page-faulted in again, every forward of a decoding run.
    _KV_BUFFER_KEEP_BYTES = 64 << 20

    def _take_kv_buffer(self, shape, dtype, device):
        """Flat storage for at least ``prod(shape)`` elements: the kept one if it fits,
        else a new one with room to grow (a context grows by a token a round)."""
        need = math.prod(shape)
        kept, self._kv_buffer = self._kv_buffer, None  # taken: no other caller shares it
        if (
            kept is not None
            and kept.numel() >= need
            and kept.dtype == dtype
            and kept.device == device
        ):
            return kept
        return torch.empty(need + need // 4, dtype=dtype, device=device)

    def _give_back_kv_buffer(self, storage):
        if storage.numel() * storage.element_size() <= self._KV_BUFFER_KEEP_BYTES:
            self._kv_buffer = storage

    def _store_kv(self, trie, plans, news, max_past, cache, kv=None):
        """Insert each row's new positions into the trie, from ``kv`` (the forward's
        buffer) when the model wrote them all there, else from the cache's layers."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        max_new = max(news)
        reusable = (DynamicLayer, buffer_layer_class())  # not their subclasses (sliding...)
        usable = bool(layers) and all(
            type(layer) in reusable
            and isinstance(getattr(layer, "keys", None), torch.Tensor)
            and layer.keys.dim() == 4
            and layer.keys.shape[2] == max_past + max_new
            and layer.keys.device == layers[0].keys.device
            and layer.keys.shape[1:] == layers[0].keys.shape[1:]
            for layer in layers
        )
        if not usable:
            warnings.warn(
                f"{type(self.model).__name__} returned a key/value cache this backend cannot "
                "reuse; key/value reuse is disabled (results are unaffected)",
                RuntimeWarning,
                stacklevel=3,
            )
            self._kv_on = False
            self.clear_kv_cache()
            return
        if (
            kv is not None
            and len(layers) == kv.shape[0]
            and all(getattr(layer, "in_place", False) for layer in layers)
        ):
            new = kv[:, :, :, :, max_past:]  # [L, 2, B, H, max_new, D], a view
        else:
            new = torch.stack(
                [
                    torch.stack((layer.keys[:, :, max_past:], layer.values[:, :, max_past:]))
                    for layer in layers
                ]
            )  # [L, 2, B, H, max_new, D]
        dtype = self._kv_dtype
        for i, ((ids, d, runs), n) in enumerate(zip(plans, news)):
            # always a copy: the buffer is reused by the next forward
            row = new[:, :, i, :, max_new - n :].to(
                dtype=dtype, memory_format=torch.contiguous_format, copy=True
            )
            trie.insert(ids, d, row, runs)

    # ---- genlm.backend's cache trie and query queue ------------------------------------
    # genlm's AsyncTransformer exposes these internals (its own tests use them); here they
    # read and feed this model's own caches and batcher (see cache_view.py).

    @property
    def _caches(self):
        """genlm's per-adapter cache tries: ``_caches[lora_name]`` is the root `CacheNode`
        of that adapter's key/value trie (None: the base model)."""
        return CacheTries(self)

    def walk_cache(self, token_ids, lora_name=None):
        """Follow ``token_ids`` down the adapter's key/value trie.

        Returns:
            (tuple): ``(node, next_token_index, past, base)``: the deepest `CacheNode` on
            the path and how many tokens it matched (all of them exactly when the answer
            for ``token_ids`` is cached or its states are stored); ``past``, a
            ``DynamicCache`` of the states of ``token_ids[:base]``, the longest fully stored
            prefix that leaves at least one token to run (None, with ``base`` 0, when there
            is none).
            ``add_query(token_ids[base:], future, past)`` runs the rest on it.
        """
        self._check_open()
        lora = self._resolve_lora(lora_name)
        ids = self._check_context(token_ids) if len(token_ids) else ()
        trie = self._kv_trie(lora)
        depth = matched(self, lora, ids)
        base, runs = trie.match(ids, max(len(ids) - 1, 0))
        past = None
        if base:
            past = dynamic_cache(trie.gather(runs))
            self._walked_pasts[past] = (lora, ids[:base])
        return CacheNode(self, lora, ids[:depth]), depth, past, base

    def add_query(self, query, future, past, lora_name=None):
        """Queue ``query`` for the next batch; ``future`` gets its next-token logits.

        Args:
            query (list[int]): The context's tokens after ``past`` (all of them if None).
            future (asyncio.Future): Set to the next-token logits ``[V']`` on the model's
                device (genlm_fast computes the last position only), or to the error that
                prevented them; it must belong to the running event loop.
            past: None, or a ``past`` that `walk_cache` returned for this adapter.
            lora_name (str, optional): The adapter; None for the default.

        Raises:
            ValueError: ``past`` did not come from `walk_cache` (genlm_fast finds stored
                states itself: pass the whole context and ``past=None``).
        """
        lora = self._resolve_lora(lora_name)
        prefix = ()
        if past is not None:
            try:
                walked = self._walked_pasts.get(past)
            except TypeError:  # not even weak-referenceable: not walk_cache's
                walked = None
            if walked is None or walked[0] != lora:
                raise ValueError(
                    "add_query's past must be one that walk_cache returned for the same "
                    "adapter; pass the whole context with past=None instead (stored "
                    "key/value states are found and reused automatically)"
                )
            prefix = walked[1]
        _, ids = self._prepare(list(prefix) + list(query), lora_name)
        self._enqueue(lora, ids, "raw", future=future)

    # ---- genlm.backend extras --------------------------------------------------------

    @torch.no_grad()
    def next_token_logprobs_uncached(self, token_ids, lora_name=None):
        """Log probabilities from one forward pass over the whole context, bypassing every
        cache: the fused decoder's where it would run the context's tokens in one forward
        (so a cached query's answer is this one, bit for bit), else transformers'."""
        lora, ids = self._prepare(token_ids, lora_name)
        self._sync_with_model()
        self._activate(lora)
        decoder = self._state.decoder if lora is None else None
        if decoder is not None and len(ids) <= self.FUSED_MAX_TOKENS:
            logits = decoder.forward([(ids, 0, [])])[0][0]
        else:
            ids_in = torch.tensor([ids], device=self._device)
            logits = self.model(ids_in, use_cache=False).logits[0, -1]
        check_finite_logits(logits[None], [ids])
        return torch.log_softmax(logits.float(), dim=-1).cpu()


def _byte_budget(value):
    """``kv_cache_bytes`` checked: None, or a whole number of bytes >= 0."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not 0 <= float(value) < float("inf")
        or float(value) != int(value)
    ):
        raise ValueError(
            f"kv_cache_bytes must be None or a whole number of bytes >= 0, got {value!r}"
        )
    return int(value)


def _learned_position_limit(model):
    """How many positions a model with a learned position embedding (GPT-2's ``wpe``, OPT's
    ``embed_positions``) has, or None for a model without one (rotary, ALiBi)."""
    config = getattr(model, "config", None)
    names = ("wpe", "embed_positions", "position_embeddings")
    if not any(
        name.rsplit(".", 1)[-1] in names and isinstance(module, torch.nn.Embedding)
        for name, module in model.named_modules()
    ):
        return None
    for key in ("n_positions", "max_position_embeddings", "n_ctx"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


# the files a saved tokenizer consists of, one at least (fast, slow BPE, SentencePiece,
# WordPiece, tiktoken)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
    "tokenizer.tiktoken",
)


def _is_missing_path(model_id):
    """True for an id that can only be meant as a local path, and does not exist."""
    if os.path.exists(model_id):
        return False
    expanded = os.path.expanduser(model_id)
    return (
        os.path.isabs(expanded)
        or model_id.startswith(("./", "../", "~"))
        or model_id.count("/") > 1
    )
