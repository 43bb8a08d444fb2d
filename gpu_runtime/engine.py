"""The step-level engine: add and abort requests, and step() the continuous batch one forward at a time."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path

import msgspec
import torch

from common.generation import model_generation
from gpu_runtime.attention.backend import make_attention_backend
from gpu_runtime.default_model import resolve_model_dir, served_name
from gpu_runtime.device import checkpoint_dtype, resolve_device, resolve_dtype
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.engine_stats import EngineSnapshot, EngineStats
from gpu_runtime.generation_defaults import load_sampling_defaults
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import RequestDelta, TokenLogprob
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.host_tier import HostPages, HostTier
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_cache.page_budget import largest_chunk
from gpu_runtime.kv_cache.page_hashes import model_salt
from gpu_runtime.kv_cache.transfer import PageExport, export_pages, import_pages
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.memory_profile import load_model_and_pool
from gpu_runtime.model.config import load_capped_model_config
from gpu_runtime.model.pooling_config import model_pooling
from gpu_runtime.model.tensor_parallel import check_divisible
from gpu_runtime.model_runner import ModelRunner
from gpu_runtime.pooling import PooledChunk, embedding_bytes
from gpu_runtime.prompt_logprobs import append_scores
from gpu_runtime.sampler import Sampler
from gpu_runtime.scheduler import Scheduler, SchedulerOutput
from gpu_runtime.sequence import Sequence, SequenceStatus
from gpu_runtime.step_failure import StepOutOfMemory
from gpu_runtime.structured.compiler import GrammarCompiler
from gpu_runtime.structured.masks import GrammarMasks
from gpu_runtime.tokenizer import Tokenizer
from gpu_runtime.tp.rank_group import DEFAULT_COLLECTIVE_TIMEOUT_S, RankGroup


class LLMEngine:
    """Owns one model, its KV pool and its scheduler. Not thread-safe: one thread drives it."""

    step_failure: StepOutOfMemory | None = None  # the latest step's, if it ran out of device memory
    # Structured outputs' compiler and mask thread, made with the first constrained request: the tokenizer they
    # need costs ~0.2 s to build, which an engine that never sees one should not pay at start.
    _grammars: GrammarCompiler | None = None
    _grammar_masks: GrammarMasks | None = None

    def __init__(self, config: EngineConfig, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        self.config = config
        # A directory, a .gguf file (converted into the cache once), a built-in model's name, or none: the default.
        # No rank multiplies GGUF blocks under tensor parallelism (plan_quantized refuses them), so there "auto"
        # serves the float32 conversion, as it does on a device without the kernel.
        quantization = config.quantization if config.tensor_parallel_size == 1 else "none"
        model_dir = resolve_model_dir(config.model, quantization)
        self.model_dir = model_dir
        self.model_name = config.served_model_name or served_name(config.model)
        self.model_config = load_capped_model_config(model_dir, config.max_model_len)
        check_divisible(self.model_config, config.tensor_parallel_size)  # before any rank starts
        self.tokenizer = Tokenizer(model_dir)
        # Read here, with the rest of the checkpoint, and filled in by the frontend (the one that knows which
        # fields a request set); a bad default fails the model's start, naming the file.
        self.sampling_defaults = load_sampling_defaults(model_dir, config.generation_config)
        self.chat_template = _checked_chat_template(model_dir, config.chat_template)
        self.pooling = model_pooling(model_dir, self.model_config.hidden_size)  # what its embeddings are
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype(model_dir))
        backend = make_attention_backend(config.attention_backend, self.device)
        self.attention_backend = backend.name  # what "auto" became here
        # Tensor parallelism: this process is rank 0; the others start now, as its children, and build the same
        # model from the same resolved settings, each its own shard.
        self.ranks: RankGroup | None = None
        if config.tensor_parallel_size > 1:
            resolved = msgspec.structs.replace(
                config, attention_backend=backend.name, dtype=str(self.dtype).removeprefix("torch.")
            )
            self.ranks = RankGroup(resolved, model_dir, self.device, collective_timeout_s)
        tp, channel = (self.ranks.tp, self.ranks.channel) if self.ranks else (None, None)
        # On CUDA the pool takes what the weights and a profiled largest step leave of gpu_memory_utilization;
        # self.memory holds those numbers (weights, activation peak, pages) for the ready log.
        try:
            model, pool, self.memory = load_model_and_pool(
                model_dir, self.model_config, config, backend, self.dtype, self.device, tp, channel
            )
        except BaseException:
            self.close()
            raise
        # Which weights these are; it salts the page hashes, so cached pages (and pages handed between workers)
        # never match across models or across two generations of one model's weights.
        self.generation = model_generation(model_dir)
        salt = model_salt(self.model_name, self.generation)
        # A block table per KV group (one unless the model mixes sliding and global layers); where a group's layers
        # slide, its pages behind the window go back as a sequence moves on (Mistral 7B v0.1, Gemma's sliding layers).
        try:
            self.kv = KVCacheManager(pool.num_pages, config.page_size, config.enable_prefix_caching, salt,
                                     windows=pool.layout.windows, host_tier=self._host_tier(pool))  # fmt: skip
        except BaseException:
            self.close()
            raise
        # Prompts' pages pinned for decode workers to pull (a prefill worker's; disaggregated serving).
        self.leases = KVLeases(self.kv)
        self.scheduler = Scheduler(config, self.kv)  # an EngineConfig is a SchedulerConfig
        self.runner = ModelRunner(model, pool, self.device, channel, self.kv.host.pages if self.kv.host else None)
        self.sampler = Sampler()
        self.stats = EngineStats()
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()

    def _host_tier(self, pool: KVPool) -> HostTier | None:
        """The second KV tier in host memory (kv_offload_bytes), its copies logged for the other ranks under tensor
        parallelism; None without one."""
        if not self.config.kv_offload_bytes:
            return None
        num_bytes, per_page = self.config.kv_offload_bytes, HostPages.page_bytes(pool)
        num_slots = num_bytes // per_page
        if num_slots < 1:
            raise ValueError(f"kv_offload_bytes: {num_bytes} bytes hold no KV page (one takes {per_page} bytes)")
        return HostTier(num_slots, HostPages(pool, num_slots), keep_log=self.ranks is not None)

    # -- requests -----------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        cache_salt: str = "",
        num_generated: int = 0,
    ) -> None:
        """Queues a request; raises ValueError naming the field if it can never be served.

        `num_generated`: the prompt's last tokens are the request's own output from an earlier worker (a handover
        or a migration continues it here); its structured output's matcher replays them."""
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        if not 0 <= num_generated < len(prompt_token_ids):
            raise ValueError(f"num_generated: must be in [0, {len(prompt_token_ids)}), got {num_generated}")
        matcher = self._matcher(
            params, prompt_token_ids[len(prompt_token_ids) - num_generated :] if num_generated else []
        )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)  # a seed: the same draws on any device
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_model_len=self.model_config.max_model_len,
            eos_token_ids=frozenset(self.model_config.eos_token_ids),
            generator=generator,
            priority=Priority(priority),
            cache_salt=cache_salt,
            arrival_order=next(self._arrivals),
            matcher=matcher,
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        max_len = self.model_config.max_model_len
        if params.pooling is not None:
            self._validate_pooling(len(prompt_token_ids), params)
        elif not self.model_config.generates:
            raise ValueError(f"model: {self.model_name!r} serves embeddings only (its checkpoint is a base model "
                             "without lm_head)")  # fmt: skip
        elif len(prompt_token_ids) >= max_len:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room to generate in the context of {max_len}"
            )
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias: token id {bad_bias} is outside the vocabulary [0, {vocab})")
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)  # GrammarError (a ValueError) names the field
        longest = min(len(prompt_token_ids) + params.max_tokens, max_len)
        chunk = largest_chunk(len(prompt_token_ids), self.max_prefill_chunk)
        if not self.kv.fits_pool(longest, chunk):
            raise ValueError(
                f"max_tokens: prompt plus max_tokens ({longest} tokens) need {self.kv.most_pages_held(longest, chunk)} "
                f"KV pages at once, but the whole cache holds {self.kv.num_pages}; lower max_tokens or raise "
                "kv_cache_bytes"
            )

    @property
    def max_prefill_chunk(self) -> int:
        """The most prompt tokens a step computes for one request; 0: a prompt is computed whole (not chunked, or a
        static batch)."""
        config = self.config
        if not (config.enable_chunked_prefill and config.scheduling == "continuous"):
            return 0
        # The step's budget: max_num_batched_tokens, or under an ITL target at least a page past one token per
        # running sequence (LatencyPolicy.token_budget), which a tiny max_num_batched_tokens may be below.
        return max(config.max_num_batched_tokens, config.max_num_seqs + config.page_size)

    def _validate_pooling(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """An embedding request's checks: the model can embed, the prompt fits its context (it may fill it: nothing
        is generated), and its dimensions are ones the model was trained to be truncated to."""
        if self.pooling.unsupported:
            raise ValueError(f"pooling: model {self.model_name!r} cannot embed: {self.pooling.unsupported}")
        max_len = self.model_config.max_model_len
        if num_prompt_tokens > max_len:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens are more than the context of {max_len}")
        dimensions = params.pooling.dimensions
        if dimensions is not None and (why := self.pooling.dimensions_error(dimensions)):
            raise ValueError(f"pooling.dimensions: {why}")

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            config = self.model_config
            self._grammars = GrammarCompiler.for_model(self.model_dir, config.vocab_size, list(config.eos_token_ids))
            self._grammar_masks = GrammarMasks(config.vocab_size)
        return self._grammars

    def _matcher(self, params: SamplingParams, generated: list[int]):
        if params.structured_output is None:
            return None
        matcher = self.grammars.matcher(params.structured_output)
        if generated and not matcher.consume_tokens(generated):
            raise ValueError(f"{params.structured_output.field}: the tokens generated so far do not satisfy it")
        return matcher

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Drops a request wherever it is and frees its pages; returns its final delta, or None if unknown."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._check_when_idle()
        return self._delta(seq, [], None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    # -- the loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedules, runs one forward, samples, and evicts finished sequences; returns what changed.

        A sequence whose prompt chunk did not reach its end yet computes but does not sample, so it
        appears in the outputs only once its first token exists. A step that runs out of device memory fails
        its own requests only (step_failure says which) and the steps that follow compute fewer tokens.
        """
        started = time.perf_counter()
        self.step_failure = None
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        computed = self._compute(scheduled)
        if computed is None:
            return self._fail_out_of_memory(scheduled)
        inputs, tokens, logprobs = computed
        self.scheduler.update_after_step(scheduled)
        self.stats.observe_kv(self.kv, self.scheduler.running + self.scheduler.held)
        outputs = [
            self._append_sampled(seq, token, logprob)
            for seq, token, logprob in zip(inputs.sampling, tokens, logprobs, strict=True)
        ]
        outputs += [self._finish_embedding(chunk) for chunk in inputs.pooled if chunk.completes]
        seconds = time.perf_counter() - started
        self.scheduler.policy.model.observe(scheduled.num_tokens, scheduled.num_seqs, seconds)
        self.stats.observe_step(scheduled, seconds, self.runner.forward_seconds)
        self._check_when_idle()
        return outputs

    def _compute(self, scheduled: SchedulerOutput):
        """(inputs, tokens, logprobs) of the step's forward and sampling; None if they ran out of device memory.

        Returned rather than handled here: once this frame is gone, so are the step's tensors and the
        traceback that holds them, and their memory can be released."""
        masks = None
        try:
            host = self.kv.host
            inputs = self.runner.prepare(scheduled, host.take_log() if host is not None and self.ranks else [])
            # The constrained rows' masks are computed on a thread while the forward runs.
            masks = self._grammar_masks.start(inputs.sampling) if self._grammar_masks else None
            logits, prompt_scores = self.runner.execute(inputs)
            if prompt_scores is not None:
                append_scores(list(inputs.scored), prompt_scores)
            if logits is None:  # a step of embedding requests only: nothing samples
                return inputs, [], []
            if masks is not None:
                masks.apply(logits)
            return inputs, *self.sampler(logits, inputs.sampling)
        except torch.OutOfMemoryError:
            return None
        finally:
            if masks is not None:
                masks.wait()  # the matchers advance next: never while the thread still reads them

    def _fail_out_of_memory(self, scheduled: SchedulerOutput) -> list[RequestDelta]:
        """Ends the step's requests with an error their clients read, frees their pages, releases the allocator's
        cached blocks, and halves the token budget; requests the step did not hold go on untouched."""
        failed = [*scheduled.decodes, *(work.seq for work in scheduled.prefills)]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        budget = self.scheduler.shrink_token_budget()
        self.step_failure = StepOutOfMemory(
            str(self.device), scheduled.num_tokens, tuple(seq.request_id for seq in failed), budget
        )
        outputs = []
        for seq in failed:
            self._requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, FinishReason.ERROR)
            outputs.append(self._delta(seq, [], None, error=self.step_failure.message, retryable=True))
        self._check_when_idle()
        return outputs

    def _append_sampled(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestDelta:
        queued_s = None
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
            if seq.first_scheduled_time is not None:
                queued_s = seq.first_scheduled_time - seq.arrival_time
        new_tokens, new_logprobs = [token], [logprob] if logprob else None
        if seq.params.max_tokens == 0:  # a prompt to score only: the token its last position picked is not its own
            new_tokens, new_logprobs = [], None
            seq.finish_reason = FinishReason.LENGTH
        else:
            seq.append_token(token, logprob)
        if seq.finish_reason is not None:
            self._requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, seq.finish_reason)
        # The prompt's logprobs go out once, with the first token (every prompt position is scored by then).
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and len(seq.output_token_ids) == min(1, seq.params.max_tokens):
            prompt_logprobs = [TokenLogprob(seq.prompt_token_ids[0], math.nan, []), *seq.prompt_logprobs]
        return self._delta(seq, new_tokens, new_logprobs, queued_s, error=seq.grammar_error,
                           prompt_logprobs=prompt_logprobs)  # fmt: skip

    def _finish_embedding(self, chunk: PooledChunk) -> RequestDelta:
        """An embedding request's prompt is computed: it ends here, its pages freed, its vector in the delta."""
        seq = chunk.seq
        seq.first_token_time = time.monotonic()
        queued_s = seq.first_scheduled_time - seq.arrival_time if seq.first_scheduled_time is not None else None
        seq.finish_reason = FinishReason.STOP
        self._requests.pop(seq.request_id, None)
        self.scheduler.finish(seq, seq.finish_reason)
        return msgspec.structs.replace(self._delta(seq, [], None, queued_s), embedding=embedding_bytes(seq))

    def _check_when_idle(self) -> None:
        if self.config.debug_checks and not self.scheduler.has_unfinished():
            self.check_integrity()

    def check_integrity(self) -> None:
        """Asserts the page pool's invariants against every live sequence (AssertionError if broken)."""
        sequences = self.scheduler.running + self.scheduler.held + self.scheduler.waiting
        self.kv.check_integrity(sequences, self.leases.page_lists())

    def export_prefix(self, token_ids: list[int]) -> PageExport:
        """The K/V of the longest cached prefix of `token_ids`, as tensors plus page hashes."""
        if self.runner.host_pages is not None:  # pages loaded from the host tier are read after their copies
            self.runner.host_pages.before_forward()
        return export_pages(self.kv, self.runner.pool, self.kv.lookup(self.kv.hasher.hash_tokens(token_ids)))

    def import_prefix(self, export: PageExport) -> int:
        """Adds exported pages to this engine's prefix cache; returns how many were new here."""
        return import_pages(self.kv, self.runner.pool, export)

    def check_ranks(self) -> None:
        """Raises RankLost if a tensor-parallel rank has exited (the engine cannot step again); a no-op without."""
        if self.ranks is not None:
            self.ranks.check_alive()

    def close(self) -> None:
        """Stops the other tensor-parallel ranks, if any, and the grammar mask thread. Idempotent."""
        if self.ranks is not None:
            self.ranks.close()
        if self._grammar_masks is not None:
            self._grammar_masks.close()

    def snapshot(self) -> EngineSnapshot:
        """The engine's state in a few numbers, cheap enough to read at every step."""
        return EngineSnapshot.of(self)

    @staticmethod
    def _delta(
        seq: Sequence,
        new_tokens: list[int],
        new_logprobs: list[TokenLogprob] | None,
        queued_s: float | None = None,
        error: str | None = None,
        retryable: bool = False,
        prompt_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestDelta:
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            finish_reason=seq.finish_reason if seq.status is SequenceStatus.FINISHED else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            error=error,
            queued_s=queued_s,
            retryable=retryable,
            prompt_logprobs=prompt_logprobs,
        )


def _checked_chat_template(model_dir, override: str | None) -> str | None:
    """Compiles the model's chat template here, at load, so that a broken one fails this model's start naming its
    file rather than the first chat request; returns the override as an absolute path for the frontend, which
    renders chats."""
    from common.chat_template import ChatTemplate  # the renderer's own loader: one definition of "the template"

    path = str(Path(override).resolve()) if override else None
    ChatTemplate.from_model_dir(model_dir, path)
    return path
