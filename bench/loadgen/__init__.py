"""HTTP load generator: replay a workload against an OpenAI-compatible
``/v1/completions`` endpoint and score it with the simulator's metrics.

    python -m proserve.bench.loadgen --url http://127.0.0.1:8100 --rate 2 --num-requests 200 --out out/lg
    python -m proserve.bench.loadgen --api proserve --keys keys.toml --url http://127.0.0.1:8000 \
        --rate 4 --arrivals poisson --stream-fraction 0.5 --out out/lg-proserve
    python -m proserve.bench.loadgen --from-records out/lg/requests.jsonl      # re-score a run, no sends

What one run does:

1. **Workload** (:func:`make_workload`): the same pipeline as the simulator
   (:func:`proserve.bench.workloads.build_workload`) — trace (bundled Azure
   conversation trace by default; BurstGPT, Mooncake, ShareGPT files, or
   ``synthetic``), first ``--num-requests`` rows, arrivals, seeded 50/50
   :func:`~proserve.bench.workloads.tag_priorities` with the class SLOs — plus an
   optional length shaping step (:func:`shape_lengths`: divide prompt / output
   lengths, clip prompts) for engines much faster or slower than the trace's.
   Arrivals (``--arrivals``): ``trace`` (default) keeps the trace's timestamps,
   scaled to ``--rate`` with :func:`~proserve.bench.workloads.scale_to_rate`;
   ``poisson`` replaces them with exponential gaps of mean ``1/--rate``
   (:func:`~proserve.bench.workloads.poisson_arrivals`, seeded by ``--seed``), the
   lengths still coming from the trace rows in order.
2. **Prompts**: random token ids in ``[--token-low, --vocab)`` of each
   request's prompt length, seeded per request (request ``r7`` gets the same
   prompt whatever the rate or the order of sends). ``max_tokens`` is the
   output length and ``ignore_eos`` is set, so every request must return
   exactly that many tokens. Prefix structure (issue 14): a trace with block
   ids (Mooncake ``hash_ids``) gets prompts made of blocks whose tokens depend
   on (``--seed``, block id) only (:func:`request_prompts`), so equal ids are
   equal token prefixes for a real engine's prefix cache; ``--prefix-block-tokens
   B`` shrinks each 512-token block to ``B`` tokens (prompts by ``B/512``).
   ``--multi-turn`` (:func:`make_conversation_workload`; ``--trace synthetic``
   or a ShareGPT file) sends conversations: turn ``k+1``'s prompt is turn ``k``'s
   prompt + its answer + a new message, the answer being a fixed token block of
   the answer's length (deterministic, so the simulator runs the same workload
   from the requests' prefix blocks), and it is sent when turn ``k``'s answer
   has arrived plus ``--think-time``.
3. **Sends** at the workload's arrival times (offsets from the run start, one
   asyncio task per request, no client-side concurrency limit), streaming
   (``"stream": true``) — or, for a seeded ``1 - --stream-fraction`` of the
   requests (:func:`stream_flags`: exactly ``round(F·n)`` streamed), not
   (``"stream": false``). How a request names its class and SLOs depends on
   ``--api``:

   * ``vllm`` (default; a plain vLLM server or a ProServe prefill/decode
     worker): ``vllm_xargs`` with ``priority_class``, ``weight``,
     ``ttft_slo``, ``tpot_slo``, ``arrival_time`` = the scheduled send time in
     Unix seconds, so the engine's deadlines count from the same instant as
     the client's; ``--no-xargs`` leaves them out (stock vLLM scheduling, the
     same client). ``--api-key`` is sent with every request.
   * ``proserve`` (the ProServe dispatcher, :mod:`proserve.dispatcher`):
     ``"priority": "<class>"`` and ``"slo": {"ttft_ms": ..., "tpot_ms": ...}``
     (the class's SLOs), no ``vllm_xargs`` (the dispatcher sets them), and
     the class's API key as ``Authorization: Bearer KEY``: ``--class-key
     CLASS=KEY``, else the first ``[[keys]]`` entry of that class in the
     dispatcher's ``--keys`` file (TOML or JSON), else ``--api-key``; a class
     of the workload with none of these is an error before anything is sent.

   ``--class-body CLASS=JSON`` merges extra fields into the body of one
   class's requests (e.g. vLLM's own ``{"priority": 0}``), ``--body JSON``
   into every request's. ``return_token_ids`` is asked for in both APIs (the
   dispatcher passes it through).
4. **Timestamps**: every SSE chunk is stamped when it is read; a chunk carries
   ``len(choices[0].token_ids)`` tokens (vLLM with ``return_token_ids``; the
   default, since token-id prompts without a tokenizer stream empty text), or,
   without token ids, one token per non-empty ``text`` (``--no-token-ids``,
   for servers that reject ``return_token_ids``). All tokens of a chunk get the
   chunk's time. An unstreamed response delivers all its tokens when it has
   been read, so all its token times are that instant (TTFT = the whole
   response time, TPOT = 0); its token count is ``len(choices[0].token_ids)``,
   else ``usage.completion_tokens`` (:func:`parse_response`).
5. **Results**: every request ends with a :class:`Result` — its token times,
   or an error (HTTP status and the server's message, a transport exception,
   a stream that ended early, an error event, or a token count that differs
   from ``max_tokens`` or from the final ``usage``). Note that vLLM answers a
   *streamed* request whose parameters it rejects with HTTP 200 and an error
   event carrying the 400 (``error event: (400) vllm_xargs...``); unstreamed,
   the same request gets HTTP 400. Nothing is dropped: errors
   are counted per class in the summary. Malformed SSE data lines are counted
   per request; they make the request an error only if tokens went missing.
6. **Metrics**: results become :class:`proserve.scheduler.request.Request` objects
   (:func:`to_request`; arrival = scheduled send time, token times on the same
   clock) scored by :func:`proserve.scheduler.tdg.summarize` with
   :meth:`~proserve.scheduler.tdg.GainConfig.from_workload` weights — the very code the
   simulator's tables use. A request that ended in an error keeps the tokens
   it got (they count for TDG if on time) but is not finished, so it fails
   its SLO.
7. **Report**: one table (rows ``all`` and each class; requests, errors,
   TDG_Ratio, SLO attainment, TTFT and TPOT P50/P90/P99 in seconds,
   throughput in output tokens/s and finished requests/s over first arrival →
   last token), and with ``--out``: ``requests.jsonl`` (one record per
   request, with ``stream`` true/false and its token times), ``summary.json``
   (the table's numbers and more) and, with matplotlib (``--plots``, on by
   default when it imports; ``--no-plots``), ``ttft_cdf.png``,
   ``tpot_cdf.png`` (CDFs per class) and ``classes.png`` (TDG_Ratio and SLO
   attainment per class). :func:`report_from_records` recomputes the summary
   from ``requests.jsonl`` alone (``--from-records``), so the report can be
   checked against the per-request records.

While it runs, a progress bar (tqdm when it imports, else a one-line
count on stderr; ``--quiet``: none) shows finished requests and errors.

Client health: the summary reports the send lag (actual − scheduled send)
and the client's own event-loop stalls longer than 50 ms. Both should be ~0;
if not, the client was starved of CPU and its timestamps measure itself, not
the server. Measured here: with the kernel's autogroup scheduling, a client
sharing a core with a vLLM server started in *another session* (e.g. with
``setsid``) stalled for up to 0.3-0.6 s at a time; in the same session it did
not.

Times: the run clock is ``time.perf_counter()`` minus the run start; ``arrival``
and ``token_times`` in the JSONL are seconds from the run start, and the
summary records the run start in Unix seconds.

Modules (everything public is re-exported here, so ``proserve.bench.loadgen.X`` works):

* :mod:`proserve.bench.loadgen.workload` — workload, prompt tokens, stream picks (steps 1-2)
* :mod:`proserve.bench.loadgen.body`     — :class:`ClientConfig`, request bodies, API keys (step 3)
* :mod:`proserve.bench.loadgen.sse`      — SSE parser, stream chunks, unstreamed responses (step 4)
* :mod:`proserve.bench.loadgen.scoring`  — :class:`Result`, :func:`to_request`, the summary (steps 5-6)
* :mod:`proserve.bench.loadgen.client`   — sending: :func:`replay`, stall watch (steps 3-4)
* :mod:`proserve.bench.loadgen.report`   — table, output files, re-scoring, plots, progress (step 7)
* :mod:`proserve.bench.loadgen.cli`      — the command line, :func:`main`
"""

from .body import (
    APIS,
    ClientConfig,
    api_url,
    deep_merge,
    parse_class_keys,
    read_keys_file,
    request_body,
)
from .cli import (
    add_workload_args,
    build_parser,
    client_config,
    load_classes,
    main,
    want_plots,
    workload_and_links,
    workload_from_args,
)
from .client import Run, fetch_model, replay
from .report import (
    PLOT_FILES,
    TABLE_COLUMNS,
    Progress,
    clean_json,
    format_summary,
    have_matplotlib,
    load_records,
    report_from_records,
    write_outputs,
    write_plots,
)
from .scoring import (
    STALL_S,
    Result,
    error_counts,
    result_records,
    summarize_run,
    to_request,
)
from .sse import Chunk, SSEParser, parse_chunk, parse_response
from .workload import (
    ARRIVAL_MODES,
    BUNDLED_TRACE,
    DEFAULT_TOKEN_LOW,
    DEFAULT_VOCAB,
    block_token_ids,
    blocks_prompt,
    make_conversation_workload,
    make_workload,
    prompt_tokens,
    request_index,
    request_prompts,
    send_offsets,
    shape_conversations,
    shape_lengths,
    stream_flags,
    workload_gain,
)

__all__ = [
    "APIS", "ARRIVAL_MODES", "BUNDLED_TRACE", "DEFAULT_TOKEN_LOW", "DEFAULT_VOCAB", "PLOT_FILES",
    "STALL_S", "TABLE_COLUMNS", "Chunk", "ClientConfig", "Progress", "Result", "Run", "SSEParser",
    "add_workload_args", "api_url", "block_token_ids", "blocks_prompt", "build_parser",
    "clean_json", "client_config", "deep_merge", "error_counts", "fetch_model", "format_summary",
    "have_matplotlib", "load_classes", "load_records", "main", "make_conversation_workload",
    "make_workload", "parse_chunk", "parse_class_keys", "parse_response", "prompt_tokens",
    "read_keys_file", "replay", "report_from_records", "request_body", "request_index",
    "request_prompts", "result_records", "send_offsets", "shape_conversations", "shape_lengths",
    "stream_flags", "summarize_run", "to_request", "want_plots", "workload_and_links",
    "workload_from_args", "workload_gain", "write_outputs", "write_plots",
]
