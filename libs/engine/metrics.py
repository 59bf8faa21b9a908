"""Prometheus metrics of the engine thread (``AsyncEngineBackend``), scraped with the worker's.

``strait_engine_step_seconds`` is the engine's own time per token at one stream: compare it
with the worker's ``strait_worker_itl_seconds`` and the client's ITL to see what the token path
adds (docs/performance.md, "The token path").
"""

from prometheus_client import Counter, Histogram

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1)

STEP = Histogram(
    "strait_engine_step_seconds",
    "One engine step (schedule, forward, sample, detokenize) by kind: decode (every scheduled "
    "sequence decodes one token) or mixed (prefill chunks in the batch)",
    ["kind"],
    buckets=STEP_BUCKETS,
)

STEPS_OVER_TARGET = Counter(
    "strait_engine_steps_over_target_total",
    "Steps that took longer than engine.itl_target_ms, by why: decode_rows (the decode rows "
    "alone were predicted over it: the worker is saturated), prefill_floor (the floor of "
    "min_prefill_tokens took it over), mispredicted (predicted under it), unfitted (before "
    "the step-cost model had seen enough steps)",
    ["reason"],
)

GRAMMAR_COMPILE = Histogram(
    "strait_grammar_compile_seconds",
    "Turning a request's constraint into a validated grammar (worker thread, before queueing)",
    ["result"],  # hit: already validated on this worker; miss: validated now
    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5),
)
GRAMMAR_MASK = Histogram(
    "strait_grammar_mask_seconds",
    "Filling and applying the allowed-token masks of one step's constrained rows",
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
CONSTRAINED_ROWS = Histogram(
    "strait_grammar_constrained_rows",
    "Constrained rows in a step that has any",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)

SPEC_PROPOSED = Counter(
    "strait_spec_proposed_tokens_total",
    "Tokens proposed by speculative decoding and verified in a forward",
    ["model", "method"],
)
SPEC_ACCEPTED = Counter(
    "strait_spec_accepted_tokens_total",
    "Proposed tokens kept (equal to the token the model sampled at their position); "
    "acceptance rate = accepted / proposed",
    ["model", "method"],
)
SPEC_ACCEPTED_LENGTH = Histogram(
    "strait_spec_accepted_length",
    "Proposed tokens kept per verification of one sequence (each also yields one sampled token)",
    ["model", "method"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)

# LoRA adapters (libs/engine/lora), by adapter name (bounded by the pool's adapters).
LORA_REQUESTS = Counter(
    "strait_lora_requests_total", "Requests admitted on a LoRA adapter", ["adapter"]
)
LORA_TOKENS = Counter(
    "strait_lora_output_tokens_total", "Output tokens generated on a LoRA adapter", ["adapter"]
)
LORA_LOADS = Counter(
    "strait_lora_loads_total",
    "LoRA adapters read from disk into a slot (on demand or by strait adapters load)",
    ["adapter"],
)
LORA_EVICTIONS = Counter(
    "strait_lora_evictions_total",
    "LoRA adapters evicted from their slot, least recently used, to make room for another",
    ["adapter"],
)
