"""The engine's configuration: what one :class:`~libs.engine.engine.LLMEngine` needs to load a
model and serve it (``EngineSettings``, with its speculative decoding and structured-output
parts), and the model id its KV blocks hash under (:func:`model_identity`).

The fleet's settings (``libs/settings/``) embed these as ``Settings.engine`` and a pool's
overrides (``Settings.engine_for``) and hand the result to the engine; the engine reads nothing
else. Field comments are the reference (``docs/engine.md`` explains the trade-offs).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class SpeculativeSettings(BaseModel):
    """Speculative decoding (libs/engine/spec, docs/speculation.md): a proposer guesses the next
    tokens of a decoding sequence and one forward verifies them; the answer never changes (a
    proposal is kept only where it equals the token the model itself samples)."""

    # "off"; "ngram": prompt lookup in the sequence's own prompt and output; "suffix": the same,
    # then the recent outputs of the worker's other requests; "draft": `draft_model` proposes.
    method: Literal["off", "ngram", "suffix", "draft"] = "off"
    # "draft": a model of the registry (or a local directory) with the target's vocabulary,
    # run greedily by the same worker, on a KV cache of its own of `draft_kv_cache_bytes`.
    draft_model: str = ""
    draft_kv_cache_bytes: int = Field(default=64 * 2**20, gt=0)
    # Most tokens proposed for one sequence in one step (its adaptive depth starts here).
    num_speculative_tokens: int = Field(default=4, ge=1, le=16)
    # Longest and shortest tail of the sequence (tokens) looked up; longer matches first.
    prompt_lookup_max: int = Field(default=4, ge=1, le=16)
    prompt_lookup_min: int = Field(default=2, ge=1, le=16)
    # "suffix": tokens of other requests' outputs kept for lookup (oldest dropped first).
    suffix_cache_tokens: int = Field(default=65536, ge=0)
    # No proposals in a step where more sequences than this decode (a hard cap; under it,
    # `adaptive` weighs each sequence's acceptance against the measured cost of a proposal).
    disable_by_batch_size: int = Field(default=32, ge=0)
    # Per sequence, a keep rate (an EMA with this weight on the newest verification) and the
    # engine's own decode step times (a + b x rows) decide how many proposals run: those that
    # lift the batch's expected tokens per second (docs/speculation.md, "Adaptive depth"); a
    # sequence at 0 tries one token again after `adaptive_probe_steps`.
    adaptive: bool = True
    adaptive_weight: float = Field(default=0.5, gt=0.0, le=1.0)
    adaptive_probe_steps: int = Field(default=16, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative.prompt_lookup_min exceeds prompt_lookup_max")
        if self.method == "draft" and not self.draft_model:
            raise ValueError('speculative.method = "draft" needs speculative.draft_model')
        return self


class StructuredSettings(BaseModel):
    """How a request's JSON schema and regex are read by the grammar engine
    (libs/engine/json_schema.py, docs/structured-outputs.md): as OpenAI, vLLM and llama.cpp
    users expect, so an answer ends."""

    # An object schema listing `properties` with no `additionalProperties` admits no others
    # (OpenAI's and vLLM's reading); false: JSON Schema's default, any other property.
    closed_objects: bool = True
    # Digits of an integer or number whose schema sets no maximum/minimum (llama.cpp: 16);
    # at most 18, an int64.
    max_integer_digits: int = Field(default=16, ge=1, le=18)
    # Fraction digits of a number whose schema sets no multipleOf (at most 10: the smallest
    # multipleOf the grammar engine takes is 1e-10).
    max_fraction_digits: int = Field(default=10, ge=1, le=10)
    # Regex classes read as ASCII in `structured_outputs.regex` and schema `pattern`s: "d" \d
    # = [0-9], "w" \w = [0-9a-zA-Z_], "s" \s = [ \t\n\r\f\v] (vLLM's xgrammar, llama.cpp);
    # "" leaves the grammar engine's Unicode classes.
    ascii_classes: str = Field(default="dws", pattern="^d?w?s?$")


class EngineSettings(BaseModel):
    device: str = "cpu"
    # Activations and unquantised weights. "auto": bfloat16 on a CUDA device, float32 elsewhere
    # (resolved when the settings are read, so `dtype` is never "auto" after that).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    block_size: int = 16
    # KV budget: bytes when > 0, else a fraction of free memory.
    kv_cache_bytes: int = 0
    kv_cache_memory_fraction: float = 0.25
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    # Prefill chunk (tokens of one prompt per step); 0: the whole batched-token budget.
    prefill_chunk_tokens: int = 256
    # Inter-token target of one step, ms: each step carries only as many prompt tokens as keep
    # its predicted time (libs/engine/step_cost.py: fixed + per decode row + per prompt token,
    # fitted as the worker runs) under it, so a long prompt never stalls the streams beside
    # it. 0: off (prefill_chunk_tokens a step). A pool's own `itl_target_ms` replaces it.
    itl_target_ms: float = Field(default=0.0, ge=0)
    # Prompt tokens a step computes while prompts wait, whatever the target (TTFT's floor).
    min_prefill_tokens: int = Field(default=16, ge=1)
    # Batch-class sequences sit out every step that computes an interactive prompt (they keep
    # their blocks and resume the step after), so a batch never lengthens interactive TTFT
    # (decision 0030). false: they share those steps, interactive first.
    batch_yields_to_prompts: bool = True
    # Flow control between tenants (libs/flow, docs/flow-control.md): waiting sequences are
    # admitted in the order of their tenant's weighted share of tokens served, inside priority
    # bands, and memory pressure preempts the tenant furthest over its share first. false:
    # arrival order inside a band.
    fair_share: bool = True
    # A computed prompt token's cost in that share, in output tokens: on the CPU a prompt
    # token and a decode row go through the same batched matmuls (docs/flow-control.md has the
    # measurement).
    fair_prompt_token_cost: float = Field(default=1.0, ge=0)
    # Seats beyond max_num_seqs for a waiting tenant with none running: one tenant's flood
    # never keeps another tenant's request waiting for a seat to free (0: none).
    fair_headroom_seqs: int = Field(default=4, ge=0)
    # Once that headroom is taken, a waiting tenant with none running preempts (to recompute
    # later) the newest sequence of the tenant furthest over its share (decision 0034).
    fair_preempt: bool = False
    # The first prompt of a tenant with nothing running runs in a step of its own (the other
    # tenants' rows sit out that step, keeping their blocks), at most once every this many
    # steps: its TTFT is then the rest of the step under way plus a short one, not a full
    # batch step more. 0: it shares the next step like any prompt.
    fair_first_prompt_alone_every: int = Field(default=4, ge=0)
    # Seats while a light tenant shares the engine: while two or more tenants have sequences
    # here (or had, within fair_shared_window_s) and one has at most one (a user sending one
    # request at a time), new sequences are seated only while fewer than this many run (plus
    # the headroom), so every step is short and that tenant's TTFT is the rest of a short step
    # plus its own prompt. A lone tenant, or floods beside floods, keep max_num_seqs.
    # 0: max_num_seqs always.
    # On a CPU a step's time grows with its rows (docs/flow-control.md has the trade measured);
    # on a GPU a full batch's step is short: leave it 0 there.
    fair_shared_max_num_seqs: int = Field(default=0, ge=0)
    # Seconds a tenant counts as present after its last sequence arrived or finished.
    fair_shared_window_s: float = Field(default=5.0, ge=0)
    enable_prefix_caching: bool = True
    # torch's threads in an engine process. 0: torch's default (every core); -1: every core
    # but one, for a worker that shares its machine with the rest of the fleet (its event
    # loop, the gateway, NATS): a parallel region stalls whenever another process takes one of
    # its threads' cores (docs/decisions/0011-worker-threads.md); n > 0: n.
    num_threads: int = Field(default=0, ge=-1)
    # Structured outputs: how schemas and regexes are read (StructuredSettings).
    structured: StructuredSettings = Field(default_factory=StructuredSettings)

    def threads(self) -> int:
        """The thread count ``num_threads`` resolves to on this machine."""
        import os

        if self.num_threads > 0:
            return self.num_threads
        cores = len(os.sched_getaffinity(0))
        if self.num_threads == -1:
            return max(1, cores - 1)
        import torch

        return int(torch.get_num_threads())

    # Strait's CPU kernels (packed-weight linears, paged attention; libs/engine/kernels)
    # for float32 models on the CPU: "auto" uses them when they build, "on" fails when they
    # cannot, "off" runs torch's kernels only.
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    # torch.compile the forward (with the CPU kernels): fuses transformers' small ops and drops
    # most per-op Python overhead; compiles at start (5-8 min on 2 cores the first time, then
    # loads the saved graphs, see compile_aot; `strait up` compiles ahead, libs/models/warm.py).
    # Decisions 0006, 0007.
    compile: bool = False
    # With `compile`: keep the compiled graphs on disk ahead of time (libs/engine/aot.py,
    # decision 0017) and load them at start (2.4-3.5 s measured) instead of re-tracing the model through
    # dynamo on every start (~40 s on 2 cores even with inductor's cache warm).
    compile_aot: bool = True
    # Where those graphs live; "" is `strait-aot` under inductor's cache directory
    # (TORCHINDUCTOR_CACHE_DIR, which `strait up` points at <state_dir>/inductor).
    compile_dir: str = ""
    # With `compile_aot`: a graph that has to be compiled while the engine runs (no saved
    # graph, or one that does not fit) compiles on a thread of its own while its steps run
    # eager, and is swapped in when ready, so a worker never stops serving for a compile
    # (decision 0037). false: compile before serving (`strait up`'s warm-up child).
    compile_background: bool = True
    # One linear for attention's q/k/v and one for the MLP's gate/up in every llama-family
    # layer (libs/engine/fuse.py): three kernel calls a layer fewer, the same answers.
    fuse_projections: bool = True
    # Weight format (libs/engine/quant, docs/engine.md's table): "none" keeps the checkpoint's
    # weights in `dtype`; "gguf" serves the source GGUF's blocks (4-bit types on the int4
    # kernel); "int4" / "int8" quantise a float checkpoint at load (weight-only). The
    # activations stay in `dtype`; the quantised kernels read them in bfloat16.
    quantization: Literal["none", "gguf", "int4", "int8"] = "none"
    # Input features per scale/zero of "int4" (torch's kernel takes 32, 64, 128 or 256).
    quant_group_size: Literal[32, 64, 128, 256] = 32
    # Activations into Strait's block kernel (AVX2 / AVX-512 CPUs, float32 models): "int8"
    # quantises them per 32 inputs and multiplies in integers (AVX-512 VNNI or AVX2's
    # vpmaddubsw; llama.cpp's arithmetic, ~2x faster linears); "float32" keeps them, and a
    # GGUF's Q4_0/Q4_1/Q8_0 blocks then give the bits of the float32 model converted from it.
    # Elsewhere torch's kernels take bf16 activations.
    quant_activations: Literal["int8", "float32"] = "int8"
    # K/V storage: "auto" = `dtype`. Narrower halves attention's reads; not the same answers.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Speculative decoding on this engine (a pool's own `speculative` replaces it).
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    # On a CUDA device: steps of decode tokens run as CUDA graphs, padded
    # to the next of `cuda_graph_batch_sizes` rows (and a power of two of block-table columns),
    # captured as the engine starts (the two smallest) or on first use
    # (libs/engine/cuda_graphs.py, decision 0018). With `compile` the captured forward is
    # inductor's. Ignored on a CPU.
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    )
    # Steps that carry prompt tokens (prefill chunks, mixed steps, speculative proposals) run
    # as the same graphs when they hold at most this many tokens, every token one row (their
    # logits computed for every row, the sampled ones kept); longer steps run eager. 0: only
    # steps of decode tokens use graphs.
    cuda_graph_max_tokens: int = Field(default=256, ge=0)
    # After a graphed step of plain-greedy decode rows, launch the rows' next step on the
    # device before the host has their tokens, so the GPU runs it while the host updates and
    # schedules (used when the next step is that one, dropped otherwise; decision 0018).
    cuda_run_ahead: bool = True
    # Attention in those graphs: "triton" reads each row's blocks in place with Strait's Triton
    # kernel (libs/engine/triton_attention.py), "sdpa" gathers them for torch's SDPA; "auto" is
    # "triton" where Triton is installed (torch's CUDA wheels carry it) and the head size is a
    # power of two.
    cuda_attention: Literal["auto", "triton", "sdpa"] = "auto"

    # LoRA adapters (libs/engine/lora, docs/engine.md "LoRA adapters"): at most this many
    # loaded at once, each request's rows updated by its own in one batch; 0: none (the
    # forward untouched). Every linear then costs max_loras * max_lora_rank * (in + out)
    # more multiply-adds a row, and the slots' bytes come out of the KV budget.
    max_loras: int = Field(default=0, ge=0, le=64)
    # Highest adapter rank served (an adapter of a higher rank is refused); slots are this wide.
    max_lora_rank: int = Field(default=16, ge=1, le=64)
    # The adapters this engine loads by name: `<lora_dir>/<name>/adapter_config.json` +
    # `adapter_model.safetensors` (a pool's `adapters_dir` sets it); "": only those loaded by
    # path.
    lora_dir: str = ""

    @model_validator(mode="after")
    def _resolve_auto_dtype(self) -> EngineSettings:
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if not self.cuda_graph_batch_sizes or min(self.cuda_graph_batch_sizes) < 1:
            raise ValueError("engine.cuda_graph_batch_sizes needs sizes of at least 1")
        return self

    @property
    def kv_dtype(self) -> str:
        """The K/V cache's dtype name (``kv_cache_dtype`` with ``auto`` resolved)."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def weights_tag(self) -> str:
        """What, beyond the model's name, changes its answers: "" for float32 weights,
        activations and KV; else e.g. ``gguf``, ``int4-g64+bfloat16``, ``kv-bfloat16``."""
        parts = []
        if self.quantization == "int4":
            parts.append(f"int4-g{self.quant_group_size}")
        elif self.quantization != "none":
            parts.append(self.quantization)
        if self.quantization != "none" and self.quant_activations == "int8":
            parts.append("a8")
        if self.dtype != "float32":
            parts.append(self.dtype)
        if self.kv_dtype != self.dtype:
            parts.append(f"kv-{self.kv_dtype}")
        return "+".join(parts)


def model_identity(model: str, engine: EngineSettings) -> str:
    """The id a model's KV blocks are hashed and handed off under: its name, plus the weights'
    format where that changes answers (``smollm2-135m-instruct@gguf``), so blocks computed
    under one format are never reused under another. Workers report it in their beats."""
    tag = engine.weights_tag()
    return f"{model}@{tag}" if tag else model
