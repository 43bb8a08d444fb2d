"""Every message that crosses between the frontend and a scheduler, as msgspec Structs on MessagePack.

Torch-free on purpose: the frontend imports this module too. Decoding checks each message against its
schema, unknown fields included, so bytes that are not one of these messages (a pickle included) fail to decode
and are dropped. Receivers must catch every exception of decode(), not only DecodeError: see Codec.decode.
"""

from __future__ import annotations

import msgspec

from common.lanes import DrainAction, Role
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.pooling import ModelPooling
from gpu_runtime.ipc.sampling_params import SamplingDefaults, SamplingParams
from gpu_runtime.kv_cache.kv_events import KVEvent

# -- frontend -> scheduler --------------------------------------------------------------------------------


class KVTransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a prompt's computed KV pages wait for a decode worker to pull them (vLLM's names, so operators
    recognise them): a prefill worker hands its request over with these, and the frontend sends them on with the
    rest of the request. The pages stay pinned there under a lease until pulled or expired. No pages at all (the
    prompt filled none, or prefix caching is off) is a handover too: the decode worker computes the prompt."""

    remote_engine_id: str  # the prefill worker's id
    remote_request_id: str  # the lease: the request whose prompt the pages hold
    remote_address: str  # ipc:// where the prefill worker serves pulls
    remote_block_ids: list[int]  # its pages, prompt order
    remote_page_hashes: list[bytes]  # their content hashes: the decode worker skips pages it already holds
    remote_num_tokens: int  # prompt tokens the pages hold (full pages only)
    # The lease's capability, minted by the prefill worker as it grants the lease (KVLeases.token_of): every pull,
    # lock and unlock must present it, so only the decode worker the frontend hands the request to can read, pin
    # or release the pages. Secret: never log it (nor this struct's repr). b"": no lease (no pages).
    remote_lease_token: bytes = b""


class AddRequest(msgspec.Struct, frozen=True, tag="add", forbid_unknown_fields=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # validated again as it is decoded
    priority: Priority
    # Folded into the hash of the prompt's first page: requests with different salts never share cached pages.
    cache_salt: str = ""
    # Prefill only (a prefill worker's part of a disaggregated request, sent with max_tokens 1): once the first
    # token is out, keep the prompt's pages under a lease and hand the request over (RequestDelta.handover).
    do_remote_decode: bool = False
    # The decode worker's part: pull these pages first, then run the request as a prefix hit on them.
    kv_transfer_params: KVTransferParams | None = None
    # A continuation (a handover's decode part, a migration): the prompt's last tokens are the request's own output
    # so far, which its structured output's matcher replays before it constrains the next token.
    num_generated: int = 0


class AbortRequests(msgspec.Struct, frozen=True, tag="abort", forbid_unknown_fields=True):
    request_ids: list[str]


class FrontendHello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """A frontend (re)connected. Requests of any earlier frontend have no reader any more: the scheduler aborts
    them, and answers with SchedulerReady, then with the final deltas of those it aborted (for metering)."""

    frontend_id: str
    proof: bytes  # PeerAuth.hello_proof(frontend_id, nonce): the sender read the daemon's per-boot secret
    # New at every connection the frontend makes: with the scheduler's incarnation it keys the connection's seals
    # (PeerAuth.session). A scheduler takes each nonce once, so a replayed hello opens no session.
    nonce: bytes = b""


class DrainWorker(msgspec.Struct, frozen=True, tag="drain", forbid_unknown_fields=True):
    """This worker takes no new requests (a rollout replaces it): it finishes what it runs, then exits 0. Sent
    on the same connection as the requests, so every request sent before it is known to the worker first."""

    timeout_s: float  # then what still runs ends as on_timeout says
    on_timeout: DrainAction  # abort: final deltas with finish reason abort; migrate: the same, marked `migrate`


ToScheduler = AddRequest | AbortRequests | FrontendHello | DrainWorker


# -- scheduler -> frontend --------------------------------------------------------------------------------


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The log-probability of one sampled token under the model, and optionally the top candidates."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class RequestDelta(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One request's progress in one engine step, as the engine emits it and the frontend reads it.

    Counts are authoritative and cumulative; a finish_reason ends the request on this worker. A final delta may
    say the request goes on elsewhere, explicitly: `handover` (the prefill part of a disaggregated request is
    done) or `migrate` (the worker was retired mid-stream). The client sees neither: its stream goes on.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache instead of computed
    error: str | None = None  # with FinishReason.ERROR: why the scheduler refused the request
    # On the delta with the request's first token: seconds from its arrival at the scheduler to the step that
    # first scheduled it (its queue time; the frontend adds its own wait in admission).
    queued_s: float | None = None
    # With FinishReason.ERROR: the request itself was fine and may succeed if sent again (a step that ran out of
    # device memory); the frontend answers UNAVAILABLE rather than INVALID_ARGUMENT.
    retryable: bool = False
    # With FinishReason.ABORT: the worker was retired mid-stream (a rollout's drain timeout, on_drain_timeout
    # migrate); the frontend goes on with the prompt and these tokens on a serving worker.
    migrate: bool = False
    # On a do_remote_decode request's final delta when the request continues on a decode worker (its first token
    # did not end it): where its prompt's pages wait. None on every other delta, and when the first token ended
    # the request for good (a stop token, an abort).
    handover: KVTransferParams | None = None
    # On the delta with the request's first token, when its sampling asked for prompt_logprobs: one entry per prompt
    # token, its logprob where it stands; the first token's is NaN (nothing precedes it: OpenAI's null).
    prompt_logprobs: list[TokenLogprob] | None = None
    # On an embedding request's (SamplingParams.pooling) final delta: the embedding, float32 little-endian (the
    # bytes OpenAI's base64 encoding_format sends as they are).
    embedding: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepOutputs(msgspec.Struct, frozen=True, tag="step", forbid_unknown_fields=True):
    """Every request that gained a token (or ended) in one engine step, in one message."""

    worker_id: str
    incarnation: str
    deltas: list[RequestDelta]


class SchedulerReady(msgspec.Struct, frozen=True, tag="ready", forbid_unknown_fields=True):
    """Sent once the model is loaded and warm, and again on every FrontendHello."""

    worker_id: str
    incarnation: str  # new at every process start, so a restart is never mistaken for the old process
    pid: int
    model_name: str
    model_dir: str
    group: str
    max_model_len: int
    vocab_size: int
    num_pages: int
    page_size: int
    max_num_seqs: int  # the running batch's depth: the frontend dispatches about this many at once
    # PeerAuth.ready_proof(worker_id, incarnation, kv_address): the sender read the daemon's per-boot secret
    proof: bytes
    # The model's defaults for sampling fields a request leaves unset (--generation-config); the frontend fills them.
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    # --chat-template, absolute; None: the checkpoint's own template (the frontend renders chats).
    chat_template: str | None = None
    generation: str = ""  # the weights it serves (common.generation): named in every chunk and ledger row
    max_num_batched_tokens: int = 0  # a step's token budget (the autoscaler's capacity model reads it)
    # Which part of a request this worker runs. Metadata only: whether it is routed is the daemon's worker set's
    # say (WorkerInfo.state), never this message's.
    role: Role = Role.MIXED
    # ipc:// where it serves KV pulls when it is a prefill worker: the only address the frontend lets a handover
    # of its requests name (KVTransferParams.remote_address).
    kv_address: str = ""
    # The ids that end generation (the frontend compiles structured outputs with them, as the engine does).
    eos_token_ids: tuple[int, ...] = ()
    # --tool-call-parser: how the frontend reads `auto` tool calls from this model's text (auto: its template's).
    tool_call_parser: str = "auto"
    # What its embeddings are (the defaults of an embedding request).
    pooling: ModelPooling = ModelPooling()
    generates: bool = True  # False: a base model's checkpoint without lm_head, which serves embeddings only
    # What the pages a request holds at once depend on (gpu_runtime.kv_cache.page_budget): each KV group's sliding
    # window (None: a global group; one group unless the model mixes both kinds), and the most prompt tokens a step
    # computes (0: prompts are computed whole).
    kv_windows: list[int | None] = msgspec.field(default_factory=lambda: [None])
    max_prefill_chunk: int = 0


class LoadReport(msgspec.Struct, frozen=True, tag="load", forbid_unknown_fields=True):
    """Sent several times a second from the scheduler loop: the leading indicators routing and scaling read."""

    worker_id: str
    incarnation: str
    num_running: int
    num_running_batch: int  # of which batch-class: the slots an interactive request may take
    num_waiting: int
    kv_cache_usage: float  # pages held by live sequences / all pages
    num_pages: int
    num_used_pages: int
    prefix_query_tokens: int  # cumulative since the process started
    prefix_hit_tokens: int
    num_preemptions: int
    projected_ttft_seconds: float
    mean_step_ms: float
    sent_at: float  # time.time() of the sender
    # The longest of the recent engine steps: reports come between steps, so the frontend allows a silence of
    # a few of these before it calls the scheduler stuck.
    longest_recent_step_ms: float = 0.0
    # Tokens each engine step computed (prompt chunks plus decodes), counted per bucket of ITERATION_TOKEN_BUCKETS
    # since the process started: [count <= bucket 0, count in (bucket 0, bucket 1], ..., count > the last bucket].
    iteration_token_counts: list[int] = []
    iteration_tokens_sum: int = 0
    generation: str = ""
    draining: bool = False  # it got DrainWorker: it finishes what it runs and exits
    # Disaggregated serving, cumulative since the process started: pages (and their bytes) this worker pulled
    # from prefill workers, the seconds the pulls took, pulls that failed; leases it holds for decode workers now.
    kv_pulled_pages: int = 0
    kv_pulled_bytes: int = 0
    kv_pull_seconds: float = 0.0
    kv_pull_failures: int = 0
    kv_leases_held: int = 0
    # Messages this scheduler refused since the process started (gpu_runtime.ipc.rejected_messages).
    messages_malformed: int = 0
    messages_forged: int = 0
    # The host KV tier (gpu_runtime/kv_cache/host_tier.py), cumulative since the process started: prompt tokens
    # found there (counted in prefix_hit_tokens too), pages copied to it and loaded back; its pages now.
    prefix_host_hit_tokens: int = 0
    kv_offloaded_pages: int = 0
    kv_loaded_pages: int = 0
    kv_host_pages: int = 0
    # What one more token in a step costs, by the scheduler's fitted step-time model (0 until it is fitted): the
    # frontend's price of the prompt tokens a worker would have to compute (prefix-aware routing).
    seconds_per_token: float = 0.0


class KVEvents(msgspec.Struct, frozen=True, tag="kv_events", forbid_unknown_fields=True):
    """What this worker's prefix cache gained and lost since the last (gpu_runtime/kv_cache/kv_events.py), sent
    after the step (or the handover) that did it; with `snapshot`, everything it holds now, sent right after the
    SchedulerReady that answers a hello (a new frontend knows nothing of it yet)."""

    worker_id: str
    incarnation: str
    events: list[KVEvent]
    snapshot: bool = False


ToFrontend = StepOutputs | SchedulerReady | LoadReport | KVEvents

# Upper bounds of LoadReport.iteration_token_counts' buckets: vLLM's for vllm:iteration_tokens_total.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# The most a receiving socket takes in one message (zmq.MAXMSGSIZE; a bigger one makes zmq drop the sender's
# connection). Far above any real message: the largest are an AddRequest with a whole context's prompt (about
# 5 bytes a token: under 1 MiB for 128k tokens) and a StepOutputs with top logprobs for a full batch (tens of
# KiB); far below what would let one message exhaust a receiver's memory.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


# The messages that travel as one frame, with a proof of their own inside. Every other message goes as two frames,
# [encoded, seal] (gpu_runtime.ipc.peer_auth.FrameSeal), on the session the hello and the ready opened; a receiver
# drops one whose seal is missing, forged or replayed.
UNSEALED = (FrontendHello, SchedulerReady)


class Codec:
    """Encodes what one side sends and decodes, schema-checked, what it receives."""

    def __init__(self, receives: type):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        """The message, schema-checked; raises for anything else.

        Usually msgspec.DecodeError (or ValidationError, its subclass), but not always: msgspec skips the values
        that precede a tagged union's tag field recursively, so an array nested 200k deep before the tag raises
        RecursionError whatever the schema says. Callers catch Exception."""
        return self._decoder.decode(data)


def scheduler_codec() -> Codec:
    return Codec(ToScheduler)


def frontend_codec() -> Codec:
    return Codec(ToFrontend)
