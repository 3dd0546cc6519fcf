"""The request model shared by every policy, the simulator and the engines.

A :class:`Request` carries what the paper's algorithms read (§2, §4):
priority class and weight ``w_{p(r)}``, TTFT/TPOT SLOs, arrival time, prompt
length, the output tokens emitted so far with their timestamps, its phase and
its KV length. Times are seconds on whatever clock the caller uses (simulated
time in ``sim/``, ``time.monotonic()`` in the engines); only differences matter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from . import validate
from .validate import ConfigError  # noqa: F401  (re-exported: scheduler.request.ConfigError)


class Phase(enum.Enum):
    WAITING = "waiting"        # queued, no KV computed yet
    PREFILLING = "prefilling"  # some prompt chunks computed (chunked prefill)
    DECODING = "decoding"      # first token emitted, generating
    DONE = "done"


@dataclass(frozen=True)
class PriorityClass:
    """A client priority class: its weight ``w_{p(r)}`` and default SLOs.

    Defaults (see :func:`proserve.scheduler.config.default_classes`) follow the paper's
    §5.1 set-up: two classes, ``high`` with weight 2 and ``low`` with weight 1,
    sharing the same SLOs so that only the weight differs.
    """

    name: str
    weight: float
    ttft_slo: float  # seconds
    tpot_slo: float  # seconds

    def __post_init__(self) -> None:
        validate.text("priority class", "name", self.name)
        where = f"priority class {self.name!r}"
        for attr in ("weight", "ttft_slo", "tpot_slo"):   # stored as floats
            object.__setattr__(self, attr, validate.positive(where, attr, getattr(self, attr)))


@dataclass(eq=False, slots=True)
class Request:
    """One request as the schedulers see it.

    ``output_len`` is the number of tokens the request will produce. The
    simulator knows it from the trace and uses it only to decide when a request
    finishes; policies must not read it (real engines do not know it), except
    the gain bookkeeping that needs the ideal gain at the end of a run.
    """

    id: str
    priority: str
    weight: float
    ttft_slo: float
    tpot_slo: float
    arrival: float
    prompt_len: int
    output_len: int = 1
    # --- mutable state -----------------------------------------------------
    phase: Phase = Phase.WAITING
    token_times: list[float] = field(default_factory=list)  # t_{r,i}, i = 1..
    prefill_len: int = 0     # tokens to prefill (prompt, or prompt+generated after a preemption)
    prefilled: int = 0       # tokens of prefill_len already computed
    kv_len: int = 0          # tokens whose KV is in the cache
    instance: int | None = None
    error: str | None = None  # set when the request ends with an error instead of tokens
    # --- prefix structure (scheduler.prefix) -------------------------------
    prefix_blocks: tuple[int, ...] = ()   # ids of the prompt's blocks, first to last (equal ids: equal prefixes)
    prefix_block_tokens: int = 0          # tokens per prefix block
    cached: int = 0          # of kv_len, tokens an instance's prefix cache supplied (shared, not held)

    def __post_init__(self) -> None:
        where = f"request {self.id}"
        validate.integer(where, "prompt_len", self.prompt_len)
        validate.integer(where, "output_len", self.output_len)
        validate.positive(where, "weight", self.weight)
        validate.positive(where, "ttft_slo", self.ttft_slo)
        validate.positive(where, "tpot_slo", self.tpot_slo)
        if self.prefix_blocks:   # a prefix needs its block size (scheduler.prefix)
            validate.integer(where, "prefix_block_tokens", self.prefix_block_tokens, 1)
        if self.prefill_len == 0:
            self.prefill_len = self.prompt_len

    # --- derived quantities --------------------------------------------------
    @property
    def num_emitted(self) -> int:
        """``r.output_len`` in Algorithm 1: tokens emitted so far."""
        return len(self.token_times)

    @property
    def remaining_prefill(self) -> int:
        return self.prefill_len - self.prefilled

    @property
    def holds_kv(self) -> bool:
        """Whether the request holds KV blocks of its own: it has computed some of its
        prefill (a prefix-cache hit alone is shared with the cache, not held)."""
        return self.kv_len > self.cached

    @property
    def needs_prefill(self) -> bool:
        return self.phase in (Phase.WAITING, Phase.PREFILLING)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (0 for one-token outputs)."""
        n = len(self.token_times)
        if n == 0:
            return None
        if n == 1:
            return 0.0
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    def __repr__(self) -> str:  # short, for logs
        return (f"Request({self.id}, {self.priority}, w={self.weight}, phase={self.phase.value}, "
                f"prompt={self.prompt_len}, emitted={self.num_emitted}/{self.output_len})")

    # --- state transitions used by the simulator and the engine adapters ----
    def advance_prefill(self, n_tokens: int, now: float) -> bool:
        """Record ``n_tokens`` of prefill computed in a step ending at ``now``.

        Returns True when the prefill is complete; the step then also emits a
        token (the first one, or the next one after a recompute preemption).
        """
        if n_tokens <= 0 or n_tokens > self.remaining_prefill:
            raise ValueError(f"{self.id}: bad prefill chunk {n_tokens} (remaining {self.remaining_prefill})")
        self.prefilled += n_tokens
        self.kv_len += n_tokens
        if self.prefilled < self.prefill_len:
            self.phase = Phase.PREFILLING
            return False
        self.emit(now)
        return True

    def emit(self, now: float) -> None:
        """One token emitted at ``now`` (the end of a prefill, or :meth:`decode_step`)."""
        self.token_times.append(now)
        self._after_tokens()

    def decode_step(self, now: float) -> None:
        """A decode step ending at ``now``: the previous token's KV is written, a token emitted."""
        self.kv_len += 1
        self.emit(now)

    def decode_steps(self, times) -> None:
        """``len(times)`` consecutive decode steps ending at ``times`` (a simulator macro-step)."""
        self.kv_len += len(times)
        self.token_times.extend(times)
        self._after_tokens()

    def hand_off(self) -> None:
        """Disaggregated serving as vLLM does it (and ProServe's dispatcher): the token the
        prefill step sampled is not delivered. The decode worker loads the KV of all prompt
        positions but the last, recomputes that one in its first step and samples the first
        output token itself, so every output token comes from the decode side."""
        if self.token_times:
            self.kv_len -= 1
            self.token_times.clear()
        self.phase = Phase.DECODING

    def delay_tokens(self, dt: float) -> None:
        """Every token reaches the client ``dt`` seconds after the step that made it."""
        if dt:
            self.token_times[:] = [t + dt for t in self.token_times]

    def _after_tokens(self) -> None:
        """Emitted tokens end the request once it has produced ``output_len`` of them."""
        self.phase = Phase.DONE if len(self.token_times) >= self.output_len else Phase.DECODING

    def record_tokens(self, n: int, now: float) -> None:
        """``n`` tokens reported at ``now`` by an engine or a client that tracks the request's
        progress itself (the plugin, the dispatcher): timestamps only, its phase is theirs."""
        if n > 0:
            self.token_times.extend([now] * n)

    def sync(self, prefill_len: int, computed: int, decoding: bool) -> None:
        """Mirror an engine's bookkeeping: ``computed`` tokens of KV, of which ``prefill_len``
        are prefill (prompt, or prompt + outputs after a recompute preemption)."""
        self.prefill_len = prefill_len
        self.prefilled = computed
        self.kv_len = computed
        if decoding:
            self.phase = Phase.DECODING
        else:
            self.phase = Phase.PREFILLING if computed else Phase.WAITING

    def fail(self, why: str) -> None:
        """The request ends with an error (``output_len`` keeps what it should have produced)."""
        self.error = why
        self.phase = Phase.DONE

    def end(self, error: str | None = None) -> None:
        """The request ended as an engine or the dispatcher saw it: its output length is
        the tokens it emitted (known only now), ``error`` if it did not end normally."""
        self.error = error
        self.phase = Phase.DONE
        self.output_len = max(1, len(self.token_times))

    def preempt(self) -> None:
        """Recompute-style preemption (vLLM's default): drop the KV, re-prefill
        prompt + generated tokens before the next token is emitted."""
        # the last emitted token is an input of the next step, so it is re-prefilled too
        self.prefill_len = self.prompt_len + self.num_emitted
        self.prefilled = 0
        self.kv_len = 0
        self.cached = 0
        self.phase = Phase.WAITING
