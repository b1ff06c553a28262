"""The chat protocol: every record that crosses a boundary of the chat path, in one torch-free module.

    Ingress --GenerateRequest--> ChatModel deployment --Add/Abort/Stop--> engine process
    Ingress <--[Delta | StreamError]-- ChatModel <--[TokenEvent] / Rejected / Stats-- engine process

- `SamplingParams` is built once, at the HTTP boundary (the request models' `to_params`), and checked once,
  here: the limits below are the only ones (the HTTP schema quotes them).
- `GenerateRequest` is what the chat deployment's `generate` takes: a conversation or raw prompts, the
  parameters, and the tokens of an earlier run to continue from (`resume`).
- `TokenEvent` is one token (or the end) of one sample, as the engine emits it; the chat deployment (which has
  the tokenizer) turns a stream's events into `Delta`s, each a run of tokens with their text and logprobs as
  clients see them, and sends those to the Ingress. A failure the client must see travels as a `StreamError`
  in the same lists.
- The engine process's messages (`EngineStart` ... `Stats`; `Failed` and `Stop` are core/child.py's, for both
  models' processes) are small records the two sides match on by type.

Records are frozen msgspec Structs (as vLLM's engine core uses): they pickle about as fast as plain dicts, and
faster than dataclasses (bench/README.md, "The chat protocol on the wire"); both the engine socket and Ray's
hops pickle them. Importing this module costs nothing: the Ingress imports it without torch.
The settings records (EngineConfig) are dataclasses: pydantic validates them from the config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import msgspec
from msgspec import field

# ---- sampling limits (OpenAI's where OpenAI sets one)
MAX_TEMPERATURE = 2.0
MAX_LOGIT_BIAS = 300            # tokens one request may bias
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4                    # stop strings
MIN_REPETITION_PENALTY = 0.01   # logits divided by less overflow float32 (and the penalty means nothing more)
MAX_REPETITION_PENALTY = 10.0
MAX_PENALTY = 2.0               # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
GREEDY_BELOW = 1e-5             # a temperature below this is greedy, its limit (vLLM's _SAMPLING_EPS): dividing
                                # the logits by it would overflow them

CPU_POLICIES = ("normal", "idle")   # for the engine process: see engine_process.set_cpu_policy
BACKENDS = ("model", "synthetic")  # the checkpoint's model, or synthetic.py's engine without one (benchmarks)
DTYPES = ("auto", "float32", "bfloat16")   # EngineConfig.dtype
WEIGHTS = ("dtype", "int8")                 # EngineConfig.weights
KV_CPU_BYTES = 2 << 30              # the KV cache's default size on a CPU (EngineConfig.kv_cache_memory)
KV_CUDA_SHARE = 0.85                # on CUDA, the default share of the memory left after the weights
H200_STEP_S = 0.00125               # one decode step of the demo model on an H200 (docs/deployment.md)


# ---- errors that cross the engine socket (pickled with their fields)
class SamplingError(ValueError):
    """Sampling parameters out of range; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return type(self), (str(self), self.param)


class EngineError(ValueError):
    """A request the engine cannot take as given."""


class EngineFull(RuntimeError):
    """The waiting queue is full; retry later."""


class EngineDied(RuntimeError):
    """The engine (its process or its thread) is gone."""


# ---- requests
class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 256
    temperature: float = 1.0      # 0 (or below GREEDY_BELOW) is greedy
    top_k: int | None = None      # None or 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1                    # samples of one prompt, sharing its prefill
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False      # generate max_tokens even past the end of the turn (vLLM's; for benchmarks)
    presence_penalty: float = 0.0     # OpenAI's: subtracted once from every token generated so far
    frequency_penalty: float = 0.0    # OpenAI's: subtracted per occurrence of a token generated so far
    repetition_penalty: float = 1.0   # vLLM's: a token of the prompt or output has its logit divided (> 0) or
                                      # multiplied (< 0) by it
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    logprobs: int | None = None       # None: none; k: each sampled token's logprob and the k most probable
    prompt_logprobs: int | None = None   # None: none; k: each prompt token's logprob (the model's, before any
                                         # bias or penalty) and the k most probable at its place; max_tokens may
                                         # then be 0 (score the prompt only)
    grammar: str | None = None        # structured output: an llguidance grammar (core/chat/grammars.py) every
                                      # sampled token must follow; None: free text

    @property
    def processes_logits(self) -> bool:
        """Whether the logits of this request's rows need processing before sampling (logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def __post_init__(self) -> None:
        if not isinstance(self.stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(self.stop))
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise SamplingError(f"max_tokens must be at least 1 (0 only to score the prompt), got {self.max_tokens}",
                                "max_tokens")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}",
                                "temperature")
        if self.top_k is not None and self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, got {self.top_k}", "top_k")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.n < 1:
            raise SamplingError(f"n must be at least 1, got {self.n}", "n")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError(f"stop takes up to {MAX_STOP} non-empty strings", "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise SamplingError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got "
                                    f"{getattr(self, name)}", name)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise SamplingError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                                f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}",
                                "logit_bias")
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or tok < 0:
                raise SamplingError(f"logit_bias keys must be token ids, got {tok!r}", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}",
                                    "logit_bias")
        if self.grammar is not None and self.ignore_eos:
            raise SamplingError("ignore_eos cannot be combined with a structured output: a completed grammar allows "
                                "only the end of the turn", "ignore_eos")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                                "top_logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                                "logprobs")


class SamplingDefaults(msgspec.Struct, frozen=True):
    """What a checkpoint samples with when a request leaves a value out (its chat.json)."""

    temperature: float = 0.6
    top_k: int | None = 50
    top_p: float = 1.0
    max_tokens: int = 256


@dataclass(frozen=True)
class ToolFormat:
    """A checkpoint's tool-call format (chat.json `tool_call`): a call is `start`, then `{"name": ...,
    "arguments": {...}}` in grammars.JSON_LAYOUT, then `end` (Hermes-style models: `<tool_call>` and
    `</tool_call>`)."""

    start: str
    end: str

    def call_text(self, name: str, arguments) -> str:
        return f"{self.start}{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}{self.end}"


class ChatModelInfo(msgspec.Struct, frozen=True):
    """What the Ingress knows of the chat model it serves (ChatModel.info, asked once): its name, its limits and
    what it samples with when a request leaves a value out."""

    id: str
    created: int                    # the checkpoint's time (its config file's modification time)
    sequence_len: int               # prompt + completion tokens
    max_n: int                      # samples one request may draw: the engine's rows
    vocab_size: int
    sampling_defaults: SamplingDefaults
    tool_format: ToolFormat | None = None


class ChannelTicket(msgspec.Struct, frozen=True):
    """Where a generation's messages after the first may go instead of its Serve call (deployments/channel.py):
    the Ingress replica's token channel (host, port), the key both ends prove they hold, and the stream's
    number on that channel."""

    host: str
    port: int
    key: bytes
    stream: int


class GenerateRequest(msgspec.Struct, frozen=True):
    """One generation for the chat deployment: a conversation (`messages`, rendered by its chat template) or raw
    `prompts` (text or token ids, one stream each; sample i of prompt p is choice p * n + i). `resume`: the
    token ids an earlier run of this request had delivered (one prompt, n = 1); the stream continues that run."""

    params: SamplingParams
    messages: tuple[dict, ...] | None = None
    prompts: tuple[str | tuple[int, ...], ...] | None = None
    resume: tuple[int, ...] = ()
    channel: ChannelTicket | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompts is None):
            raise EngineError("a generation takes either messages or prompts")

    def resumed(self, tokens: list[int]) -> "GenerateRequest":
        """This request, continuing from `tokens`."""
        return msgspec.structs.replace(self, resume=tuple(tokens))


# ---- what comes back
class ShownToken(msgspec.Struct, frozen=True, array_like=True):
    """A token as OpenAI's logprobs show it: its text, its UTF-8 bytes, its log-probability (None only for a
    prompt's first token, which nothing predicts)."""

    token: str
    bytes: tuple[int, ...]
    logprob: float | None


class ShownLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token's entry: the token itself and the most probable tokens at its position."""

    chosen: ShownToken
    top: tuple[ShownToken, ...]


Segment = Literal["text", "python", "python_output"]
FinishReason = Literal["stop", "length", "abort", "error"]


class TokenEvent(msgspec.Struct, frozen=True, array_like=True):
    """One token of one sample, or the end of a sample (`finish_reason` set, `token` None). Encoded as an array of
    its 14 values (msgspec 0.23 writes the defaults of an array-like struct too: `omit_defaults` leaves them)."""

    request_id: str
    index: int                      # sample index within the request (choice index at the Serve hop)
    token: int | None
    text: str = ""                  # text delta of this token in its segment
    segment: Segment = "text"       # "text", "python" (calculator call) or "python_output" (its result)
    forced: bool = False            # injected by the tool, not sampled
    closes: bool = False            # this token (<|python_end|> or <|output_end|>) ends its segment
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose keys and values were reused, not computed
    logprob: float | None = None    # of a sampled token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None   # (token id, logprob), most probable first
    # with prompt_logprobs, on the first event of a prompt's first sample: per prompt position (token id, its
    # logprob, the most probable (token id, logprob)); the first position's logprob and list are None
    prompt_logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] | None = None

    @property
    def shows_output(self) -> bool:
        """A client sees something of this event: text, or the end of a calculator part."""
        return self.closes or bool(self.text and self.segment == "text")


# StreamError.code of a chat replica whose engine has stopped (the replica is going down with it): the Ingress
# treats it as a lost replica and continues the stream on another one (deployments/resume.py)
ENGINE_STOPPED_CODE = "engine_stopped"


class StreamError(msgspec.Struct, frozen=True, array_like=True, tag_field="record", tag="error"):
    """A generation that failed in a way the client must be told: OpenAI's error fields."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class OnChannel(msgspec.Struct, frozen=True, array_like=True, tag_field="record", tag="channel"):
    """First in a stream's first message: the messages after it come on the request's token channel."""


class Delta(msgspec.Struct, frozen=True, array_like=True, tag_field="record", tag="delta"):
    """What one sample produced since its stream's last message, as the chat deployment hands it to the Ingress:
    consecutive tokens of one segment in one record (their ids, their text joined, their logprobs as clients
    see them). A token that closes a calculator part, or the sample's end, ends its record."""

    index: int                      # the choice: prompt * n + sample
    tokens: tuple[int, ...] = ()    # the token ids (forced ones included), for a continuation (resume)
    text: str = ""
    segment: Segment = "text"
    closes: bool = False            # the last token ends its calculator part
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0      # the sample's tokens so far, this record's included
    cached_tokens: int = 0
    logprobs: tuple[ShownLogprobs, ...] | None = None   # one per sampled token that has them
    logprob_offsets: tuple[int, ...] | None = None      # where each of those tokens' text starts in `text`
    prompt_entries: tuple[ShownLogprobs, ...] | None = None


# One message of a chat stream, chat deployment -> Ingress: msgpack bytes of [Delta | StreamError, ...] (Ray
# pickles bytes for nothing; msgspec writes and reads the records several times faster than pickle). One step's
# events on the engine socket, engine process -> its client: msgpack bytes of [TokenEvent, ...] (every other
# record there is pickled; a pickle starts with 0x80, a msgpack array never does). Functions, not the codecs'
# bound methods: Ray pickles the deployments that call them, and codecs do not pickle.
_ENCODER = msgspec.msgpack.Encoder()
_MESSAGE = msgspec.msgpack.Decoder(list[Delta | StreamError | OnChannel])
_EVENTS = msgspec.msgpack.Decoder(list[TokenEvent])


def encode_message(records: list) -> bytes:
    return _ENCODER.encode(records)


def decode_message(data: bytes) -> list:
    return _MESSAGE.decode(data)


def encode_events(events: list[TokenEvent]) -> bytes:
    return _ENCODER.encode(events)


def decode_events(data: bytes) -> list[TokenEvent]:
    return _EVENTS.decode(data)


class EngineStats(msgspec.Struct, frozen=True):
    running: int
    waiting: int
    rows_used: int                   # sequences holding a row (max_rows of them run at once)
    rows_total: int
    cache_tokens: int                # positions stored in the KV cache for running sequences
    cache_capacity: int              # positions the KV cache's blocks hold in all (every layer group at each)
    prefix_query_tokens: int = 0     # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0       # of those, found in cached blocks (reused, not computed)
    blocks_total: int = 0            # KV-cache blocks a sequence can hold
    blocks_used: int = 0             # held by running sequences (the rest are free or cache a prefix)
    blocks_cached: int = 0           # held by nobody and caching a prefix (kept until a block is needed)
    block_size: int = 0              # positions per block
    preemptions: int = 0             # running requests whose blocks were taken back, to be computed again
    evictions: int = 0               # cached blocks reused for something else

    @property
    def cache_usage(self) -> float:
        """Share of the KV cache's blocks held by running sequences (vLLM's kv_cache_usage_perc)."""
        if self.blocks_total:
            return self.blocks_used / self.blocks_total
        return self.cache_tokens / self.cache_capacity if self.cache_capacity else 0.0


# ---- configuration
@dataclass(frozen=True)
class EngineConfig:
    """How a chat engine runs: its rows and queues (LLMEngine) and where it steps (engine_process.start_engine).
    Each default here is the one default of that setting (the deployment's settings embed this record)."""

    max_rows: int = 32              # sequences in one step at most (vLLM's max_num_seqs); each holds a row of state
    prefill_chunk: int = 512        # prompt tokens prefilled per step while other streams decode
    max_waiting: int = 256          # requests queued inside the engine before it refuses (EngineFull)
    # bytes of KV cache (the block pool; kv_cache.py). None: on CUDA KV_CUDA_SHARE of the device memory left free
    # after the weights, on a CPU KV_CPU_BYTES (touched as it is used, so resident memory is what is used)
    kv_cache_memory: int | None = None
    block_size: int = 16            # positions per KV-cache block (a multiple of 4: the decode kernel's tile)
    cuda_graphs: bool = True        # on CUDA, decode passes replay recorded graphs
    prefix_caching: bool = True     # reuse the keys and values of prompts computed before (shared blocks)
    process: bool = True            # step the engine in a child process (engine_process.py), not on a thread
    torch_threads: int | None = None   # torch's intra-op threads for the model (None: torch's choice)
    cpu_policy: Literal["normal", "idle"] = "normal"   # "idle": the engine process runs under SCHED_IDLE
    backend: Literal["model", "synthetic"] = "model"   # "synthetic": synthetic.py's engine, no model (benchmarks and tests)
    synthetic_step_s: float = H200_STEP_S          # the synthetic engine's step time (one token per running row)
    packed_linear: bool = True      # on the CPU, linear layers through oneDNN with weights packed once (packed.py)
    # on the CPU, bf16 products of a decode step's one or two rows through small_linear.py's kernel, which reads
    # the weights at the memory's rate (packed.SMALL_ROWS; with packed_linear)
    small_row_kernel: bool = True
    # on the CPU, with small_row_kernel, a decode step of a few rows (decode_stack.ROWS: bf16 2, fp32 4, int8 weights
    # with fp32 activations 8) runs the model's blocks in one C++ call (decode_stack.py): the same products and
    # attention without the small ops and Python between them
    fused_decode: bool = True
    # on the CPU, decode reads a prefix that rows hold as copies of one row (prefix-cache hits, n samples) once
    # for all of them (attention.py); the same results either way
    shared_prefix_attention: bool = True
    # on the CPU, torch threads for attention alone (the decode kernel, prefill's SDPA): memory-bound work that a
    # second core speeds up where the products' small steps gain little (attention.py); None: as many as the model
    attention_threads: int | None = None
    # the model's and its KV cache's precision; "auto": bf16 on CUDA and on CPUs that compute it natively (AMX,
    # AVX-512 BF16), fp32 elsewhere (weights.chat_dtype)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # the linear layers' weights: "dtype" as the model's dtype; "int8": int8 with a scale per output channel,
    # quantized at load (quantized.py), the activations and the KV cache in the model's dtype
    weights: Literal["dtype", "int8"] = "dtype"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"the chat engine is one of {list(BACKENDS)}, not {self.backend!r}")
        if not 0 <= self.synthetic_step_s <= 10:
            raise ValueError(f"synthetic_step_s must be in [0, 10] seconds, got {self.synthetic_step_s}")
        if self.attention_threads is not None and self.attention_threads < 1:
            raise ValueError(f"attention_threads must be at least 1 (or None: every core), got {self.attention_threads}")
        if self.cpu_policy not in CPU_POLICIES:
            raise ValueError(f"cpu_policy must be one of {list(CPU_POLICIES)}, not {self.cpu_policy!r}")
        if self.cpu_policy != "normal" and not self.process:
            raise ValueError("an engine CPU policy other than 'normal' needs the engine in its own process "
                             "(process=True): on a thread it would also slow the replica's event loop")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, not {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {list(WEIGHTS)}, not {self.weights!r}")
        if self.max_rows < 1 or self.max_waiting < 0:
            raise ValueError("max_rows must be at least 1 and max_waiting not negative")
        if self.block_size < 4 or self.block_size % 4:
            raise ValueError(f"block_size must be a positive multiple of 4, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")


# ---- the engine process's messages
class EngineStart(msgspec.Struct, frozen=True):
    """parent -> child, once: what the child builds its engine from (the weights are read there)."""

    checkpoint: str
    device: str | None
    config: EngineConfig
    prefix_ids: tuple[int, ...] = ()


class Add(msgspec.Struct, frozen=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    resume: tuple[int, ...] = ()


class Abort(msgspec.Struct, frozen=True):
    request_id: str


class EngineReady(msgspec.Struct, frozen=True):
    """child -> parent, once: the engine is built."""

    device: str
    pid: int
    torch_threads: int
    cpu_policy: str
    linear: str = ""        # how the model's linear layers run: LLMEngine.linear
    attention: str = ""     # how decode attention runs: LLMEngine.attention
    dtype: str = ""         # the model's precision: LLMEngine.dtype
    decode: str = ""        # how a decode pass of a few rows runs the blocks: LLMEngine.decode


class Rejected(msgspec.Struct, frozen=True):
    request_id: str
    error: Exception


class Stats(msgspec.Struct, frozen=True):
    stats: EngineStats
