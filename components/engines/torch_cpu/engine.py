"""The engine core: a pure step loop (schedule -> forward -> sample -> update).

No sockets or clocks, and no threads but the optional disk KV tier's writer
(``kv_tiers``): the worker process calls ``add_request``,
``abort`` and ``step`` and publishes what comes back (tokens, KV events,
stats). Disaggregation hooks: a ``prefill_only`` request keeps its blocks
after its first token, and a decode engine can reserve blocks for KV that
another engine writes (``allocate_remote``) and then continue the request
(``resume_remote``).  LoRA adapters are loaded into slots (``add_lora``) and applied to
the rows of the requests that name them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .attention import decode_mask, prefill_mask
from .config import EngineConfig, ModelConfig
from .grammar import JsonGrammars
from .kv_cache import KVCacheManager, block_nbytes
from .kv_tiers import build_tiers
from .lora import LoraSlots, LoraWeights, read_lora
from splitserve.contracts.block_events import KvEvent
from .model import ForwardBatch, LlamaWeights, PrefillSpan, forward
from .request import (
    EngineStats,
    ParkedKv,
    RemoteKvAllocation,
    Request,
    RequestOutput,
    SeqStatus,
    Sequence,
)
from .sampler import Sampled, prompt_logprobs, sample_batch, skip_draw
from .scheduler import Scheduler, SchedulerOutput


@dataclass
class LogitLayout:
    """Which rows of a step's logits serve what: ``sample_rows[i]`` is ``samplers[i]``'s
    next-token row; ``prompt_spans`` are (sequence, first row, first position, count)
    runs of prompt positions whose logits score the prompt (prompt log-probabilities)."""

    samplers: list[Sequence] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


class EngineCore:
    """Continuous-batching Llama engine over a paged, prefix-cached KV pool."""

    def __init__(
        self, weights: LlamaWeights, model_config: ModelConfig, config: EngineConfig,
        grammars: JsonGrammars | None = None,
    ) -> None:
        self.weights = weights
        self.grammars = grammars  # structured output; None: requests with a schema refused
        self.model_config = model_config
        self.config = config
        shape = (model_config.num_layers, model_config.num_kv_heads, model_config.head_dim)
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            *shape,
            tiers=build_tiers(config, block_nbytes(config.block_size, *shape)),
        )
        self.scheduler = Scheduler(config, self.kv)
        self.loras = LoraSlots(config.max_loras)
        model_len = config.max_model_len or model_config.max_position_embeddings
        # A lone sequence must always fit, so preemption can never starve it.
        self.max_seq_len = min(
            model_len, model_config.max_position_embeddings, config.num_blocks * config.block_size
        )
        self._seqs: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}  # finished prefill-only requests keeping KV
        self._parked: dict[str, Sequence] = {}  # running requests stopped to move their KV
        self._pending: list[RequestOutput] = []  # produced outside step() (abort, resume)
        self._arrivals = itertools.count()
        self._num_generated = 0
        self._num_steps = 0

    # ---- requests --------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue ``req``; it is admitted by a later ``step``.

        Raises ValueError for a duplicate id or a prompt that can never fit
        (longer than the model or the whole KV pool allows).
        """
        self._queue(self._new_sequence(req))

    def abort(self, request_id: str) -> None:
        """Stop ``request_id`` wherever it is; the next ``step`` reports it as aborted."""
        if request_id in self._held:
            self.release_kv(request_id)
            return
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running, or has output not yet returned."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration and return what each affected request produced.

        A forward pass that raises is retried one request at a time; a request that
        still fails alone finishes with ``finish_reason="error"`` and the others go on.
        An exception that escapes (bookkeeping or sampling failed, so the engine's state
        is unknown) means the engine cannot continue.
        """
        plan = self.scheduler.schedule()
        if not plan.empty:
            self._num_steps += 1
            try:
                logits, layout = self._compute(plan)
            except Exception as exc:  # noqa: BLE001 - isolated below
                self._run_alone(plan, exc)
            else:
                self._apply(plan, logits, layout)
        outputs, self._pending = self._pending, []
        return outputs

    def close(self) -> None:
        """Release the KV offload tiers (the disk tier's writer and files); called when
        the engine stops."""
        self.kv.close()

    def drain_kv_events(self) -> list[KvEvent]:
        """Return (and forget) the BlockStored / BlockRemoved events since the last call."""
        return self.kv.drain_events()

    def announce_kv_events(self) -> list[KvEvent]:
        """The events a router that started late needs: those not drained yet, then a
        store for every cached block (``KVCacheManager.announced_events``), so the
        announcement follows what happened before it."""
        return self.drain_kv_events() + self.kv.announced_events()

    def stats(self) -> EngineStats:
        """Snapshot of load, KV usage and cumulative counters."""
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_kv=sum(
                q.status is SeqStatus.WAITING_FOR_KV for q in self._seqs.values()
            ),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_cached=self.kv.num_cached_blocks,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            num_preemptions=s.num_preemptions,
            num_generated_tokens=self._num_generated,
            num_steps=self._num_steps,
        )

    def kv_pool(self) -> torch.Tensor:
        """The KV pool tensor (see ``KVCacheManager``), e.g. for registration with NIXL."""
        return self.kv.pool()

    def block_table(self, request_id: str) -> list[int]:
        """Block ids currently holding ``request_id``'s KV, in token order."""
        return self.kv.block_table(request_id)

    def check_token_ids(self, token_ids, request_id: str = "") -> None:
        """Raise ValueError unless every id is a token of this model's vocabulary.

        Called for every prompt before it touches the engine (an id outside the
        embedding table would fail inside a step, or wrap around silently)."""
        vocab = self.model_config.vocab_size
        for i, t in enumerate(token_ids):
            if not (isinstance(t, int) and 0 <= t < vocab):
                raise ValueError(f"request {request_id!r}: token id {t!r} at position {i} is "
                                 f"outside the vocabulary [0, {vocab})")

    # ---- LoRA adapters -----------------------------------------------------------------
    def read_lora(self, path: str) -> LoraWeights:
        """Read the adapter directory ``path`` for this model within ``max_lora_rank``
        (ValueError naming what is wrong).  Reads files and this engine's fixed shape
        only, so it may run off the engine thread, before ``add_lora``."""
        return read_lora(path, self.model_config, self.config.max_lora_rank)

    def add_lora(self, name: str, adapter: LoraWeights) -> dict[str, str]:
        """Load ``adapter`` under ``name`` (a no-op when loaded from the same directory
        already; ValueError when no slot is left); returns the adapters now loaded."""
        self.loras.add(name, adapter)
        return self.loras.paths()

    def remove_lora(self, name: str) -> dict[str, str]:
        """Unload adapter ``name`` and unpublish the prefix blocks computed with it;
        KeyError when it is not loaded, ValueError while a request (waiting, running,
        holding or parking KV) uses it.  Returns the adapters still loaded."""
        if name not in self.loras:
            raise KeyError(f"adapter {name!r} is not loaded")
        users = [rid for rid, seq in (*self._seqs.items(), *self._held.items(),
                                      *self._parked.items()) if seq.request.lora == name]
        if users:
            raise ValueError(f"adapter {name!r} is in use by {len(users)} request(s) "
                             f"({', '.join(sorted(users)[:3])})")
        self.loras.remove(name)
        self.kv.forget_lora(name)
        return self.loras.paths()

    # ---- disaggregation ----------------------------------------------------------------
    def cached_prefix_tokens(self, token_ids, lora_name: str | None = None) -> int:
        """Prompt tokens this engine's prefix cache holds now for adapter ``lora_name``
        (None: the base model); read-only, for the decider."""
        return self.kv.cached_prefix_tokens(token_ids, lora_name)

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished prefill-only request kept (after its KV was sent)."""
        seq = self._held.pop(request_id)
        self.kv.free(seq.request_id)

    def park(self, request_id: str) -> ParkedKv | None:
        """Stop a running request between steps and keep its KV, so another engine can
        continue it from there (a live move); None, changing nothing, when it cannot
        move: not running (waiting, mid-prompt, finished) or with state that does not
        travel with its KV (a grammar's matcher, log-probabilities).  Parked blocks stay
        allocated until ``release_parked``; ``abort`` leaves them alone."""
        seq = self._seqs.get(request_id)
        if (seq is None or seq.status is not SeqStatus.RUNNING
                or seq.num_computed != seq.num_tokens - 1 or seq.matcher is not None
                or seq.request.logprobs is not None
                or seq.request.prompt_logprobs is not None):
            return None
        self.scheduler.running.remove(seq)
        del self._seqs[request_id]
        seq.status = SeqStatus.FINISHED
        self._parked[request_id] = seq
        return ParkedKv(request_id, tuple(self.kv.block_table(request_id)),
                        tuple(seq.all_token_ids))

    def release_parked(self, request_id: str) -> None:
        """Free a parked request's blocks (moved, or nobody came for them)."""
        if self._parked.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def allocate_remote(self, req: Request) -> RemoteKvAllocation | None:
        """Reserve blocks for ``req``'s prompt, to be filled by a prefill engine.

        Called on a decode engine. Reuses this engine's cached prefix; returns
        None (reserving nothing) when the pool has no room right now, so the
        caller can fall back to a local prefill.
        """
        seq = self._new_sequence(req)
        n = len(req.prompt_token_ids)
        cached = self.kv.open_sequence(req.request_id, req.prompt_token_ids,
                                       lora_name=req.lora)
        if not self.kv.allocate(req.request_id, n):
            self.kv.free(req.request_id)
            return None
        self._seqs[req.request_id] = seq
        seq.status = SeqStatus.WAITING_FOR_KV
        seq.num_cached_tokens = cached
        self.scheduler.prefix_query_tokens += n
        self.scheduler.prefix_hit_tokens += cached
        return RemoteKvAllocation(
            req.request_id, tuple(self.kv.block_table(req.request_id)), cached
        )

    def resume_remote(self, request_id: str, first_token_id: int) -> None:
        """Continue a request whose prompt KV has been written into its blocks.

        ``first_token_id`` is the token the prefill engine sampled; it is
        returned by the next ``step`` and decoding goes on from it exactly as if
        this engine had run the prefill.
        """
        seq = self._seqs[request_id]
        if seq.status is not SeqStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV ({seq.status.value})")
        seq.num_computed = len(seq.request.prompt_token_ids)
        self.kv.commit(request_id, seq.request.prompt_token_ids, seq.num_computed)
        if seq.request.temperature > 0:
            skip_draw(seq.generator)
        seq.status = SeqStatus.RUNNING
        self.scheduler.running.append(seq)
        self._append_token(seq, first_token_id)
        if seq.status is SeqStatus.RUNNING:
            self._pending.append(self._output(seq))

    # ---- internals ----------------------------------------------------------------------
    def _new_sequence(self, req: Request) -> Sequence:
        if (req.request_id in self._seqs or req.request_id in self._held
                or req.request_id in self._parked):
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.check_token_ids(req.prompt_token_ids, req.request_id)
        n = len(req.prompt_token_ids)
        if n + 1 > self.max_seq_len:
            raise ValueError(
                f"request {req.request_id!r}: prompt of {n} tokens can never fit "
                f"(limit {self.max_seq_len - 1}: model length {self.config.max_model_len or self.model_config.max_position_embeddings}, "
                f"KV pool {self.config.num_blocks} blocks x {self.config.block_size} tokens)"
            )
        gen = None
        if req.temperature > 0:
            gen = torch.Generator()
            gen.manual_seed(req.seed if req.seed is not None else torch.seed())
        lora = None
        if req.lora is not None:
            try:
                lora = self.loras.get(req.lora)
            except ValueError as exc:
                raise ValueError(f"request {req.request_id!r}: {exc}") from None
        stop = frozenset(req.stop_token_ids) | frozenset(self.model_config.eos_token_ids)
        seq = Sequence(req, next(self._arrivals), stop, gen, lora=lora)
        if req.json_schema is not None:
            if self.grammars is None:
                raise ValueError(f"request {req.request_id!r}: this engine was built "
                                 "without a tokenizer for structured output")
            seq.matcher = self.grammars.matcher(req.json_schema)
        return seq

    def _queue(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def _compute(self, plan: SchedulerOutput) -> tuple[torch.Tensor, LogitLayout]:
        """Build the batch and run the forward pass; changes no bookkeeping, so a plan
        whose computation raised can be run again (its KV slots are simply rewritten)."""
        batch, layout = self._build_batch(plan)
        with torch.inference_mode():
            logits = forward(
                self.weights, self.model_config, self.kv.pool(), batch, self.config.attention_tile
            )
        return logits, layout

    def _run_alone(self, plan: SchedulerOutput, exc: Exception) -> None:
        """The batch failed: run each of its requests alone, failing those that still raise."""
        parts = [SchedulerOutput(prefills=[c]) for c in plan.prefills]
        parts += [SchedulerOutput(decodes=[s]) for s in plan.decodes]
        if len(parts) == 1:
            self.fail(parts[0].prefills[0].seq if parts[0].prefills else parts[0].decodes[0],
                      exc)
            return
        for part in parts:
            seq = part.prefills[0].seq if part.prefills else part.decodes[0]
            try:
                logits, layout = self._compute(part)
            except Exception as alone_exc:  # noqa: BLE001 - this request is the bad one
                self.fail(seq, alone_exc)
            else:
                self._apply(part, logits, layout)

    def fail(self, seq: Sequence, exc: BaseException) -> None:
        """Finish ``seq`` with ``finish_reason="error"`` (its blocks are freed)."""
        seq.error = f"engine step failed: {type(exc).__name__}: {exc}"
        self._finish(seq, "error")

    def _apply(self, plan: SchedulerOutput, logits: torch.Tensor, layout: LogitLayout) -> None:
        for chunk in plan.prefills:
            chunk.seq.num_computed = chunk.end
        for seq in plan.decodes:
            seq.num_computed += 1
        for seq in [c.seq for c in plan.prefills] + plan.decodes:
            self.kv.commit(seq.request_id, seq.all_token_ids, seq.num_computed)
        for seq, row0, start, count in layout.prompt_spans:
            nxt = list(seq.request.prompt_token_ids[start + 1 : start + 1 + count])
            lps, tops = prompt_logprobs(logits[row0 : row0 + count], nxt,
                                        seq.request.prompt_logprobs or 0)
            seq.prompt_logprobs += lps
            seq.prompt_top_logprobs += tops
        picks = sample_batch(logits[layout.sample_rows], layout.samplers)
        for seq, picked in zip(layout.samplers, picks, strict=True):
            self._append_token(seq, picked.token, picked)
            if seq.status is SeqStatus.RUNNING:
                self._pending.append(self._output(seq))

    def _append_token(self, seq: Sequence, token: int, picked: Sampled | None = None) -> None:
        """Record a new token and finish the sequence if it should stop."""
        seq.output_ids.append(token)
        if seq.matcher is not None and not seq.matcher.is_terminated():
            seq.matcher.accept_token(token)
        if seq.request.logprobs is not None:
            # A token sampled elsewhere (disaggregated prefill) carries no logprobs here.
            seq.logprobs.append(picked.logprob if picked and picked.logprob is not None
                                else float("nan"))
            seq.top_logprobs.append(picked.top if picked else ())
        self._num_generated += 1
        if token in seq.stop_ids:  # never before min_tokens: the sampler bans them
            self._finish(seq, "stop")
        elif (
            len(seq.output_ids) >= seq.request.max_tokens
            or seq.num_tokens >= self.max_seq_len
            or seq.request.prefill_only
        ):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.status = SeqStatus.FINISHED
        del self._seqs[seq.request_id]
        blocks: tuple[int, ...] = ()
        if seq.request.prefill_only and reason not in ("abort", "error"):
            blocks = tuple(self.kv.block_table(seq.request_id))
            self.scheduler.running.remove(seq)
            self._held[seq.request_id] = seq
        else:
            self.scheduler.remove(seq)
        self._pending.append(self._output(seq, blocks))

    def _output(self, seq: Sequence, kv_block_ids: tuple[int, ...] = ()) -> RequestOutput:
        start = seq.num_emitted
        new = tuple(seq.output_ids[start:])
        seq.num_emitted = len(seq.output_ids)
        asked = seq.request.logprobs is not None
        prompt = None
        if seq.request.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            seq.prompt_logprobs_sent = True
            prompt = (tuple(seq.prompt_logprobs), tuple(seq.prompt_top_logprobs))
        return RequestOutput(
            logprobs=tuple(seq.logprobs[start:]) if asked else None,
            top_logprobs=tuple(seq.top_logprobs[start:]) if asked else None,
            prompt_logprobs=prompt[0] if prompt else None,
            prompt_top_logprobs=prompt[1] if prompt else None,
            request_id=seq.request_id,
            new_token_ids=new,
            finished=seq.status is SeqStatus.FINISHED,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.request.prompt_token_ids),
            num_cached_tokens=max(seq.num_cached_tokens, 0),
            kv_block_ids=kv_block_ids,
            error=seq.error,
        )

    def _build_batch(self, plan: SchedulerOutput) -> tuple[ForwardBatch, LogitLayout]:
        """Pack the plan into flat tensors; also say which logit rows serve what."""
        bs = self.config.block_size
        tile = self.config.attention_tile
        group = self.model_config.group_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        prefills: list[PrefillSpan] = []
        logit_rows: list[int] = []
        layout = LogitLayout()
        samplers = layout.samplers
        lora_rows: dict[LoraWeights, list[int]] = {}  # adapter -> the rows using it

        def padded(table: list[int], num_keys: int) -> list[int]:
            nb = -(-num_keys // tile) * (tile // bs)
            return table[:nb] + [0] * (nb - min(nb, len(table)))

        def place(seq: Sequence, start: int, end: int) -> list[int]:
            if seq.lora is not None:
                rows = lora_rows.setdefault(seq.lora, [])
                rows.extend(range(len(tokens), len(tokens) + end - start))
            table = self.kv.block_table(seq.request_id)
            tokens.extend(seq.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_blocks.extend(table[p // bs] for p in range(start, end))
            return table

        decode_rows: list[tuple[Sequence, int]] = [(s, s.num_tokens - 1) for s in plan.decodes]
        chunks = plan.prefills
        if not decode_rows and len(chunks) == 1 and chunks[0].end - chunks[0].start == 1:
            # A one-token chunk is exactly a decode row (same attention recipe).
            decode_rows, chunks = [(chunks[0].seq, chunks[0].start)], []
        if len(decode_rows) == 1 and not chunks:
            # One row would send every matmul down MKL's GEMV path, which rounds
            # differently from the batched GEMM; compute the row twice instead.
            decode_rows = decode_rows * 2
        for chunk in chunks:
            row0 = len(tokens)
            table = place(chunk.seq, chunk.start, chunk.end)
            span_pos = torch.arange(chunk.start, chunk.end)
            nb = len(padded(table, chunk.end))
            prefills.append(
                PrefillSpan(
                    row0,
                    len(tokens),
                    torch.tensor(padded(table, chunk.end)),
                    prefill_mask(span_pos, nb * bs, group),
                )
            )
            _score_prompt_rows(chunk.seq, chunk.start, chunk.end, row0, logit_rows, layout)
            if chunk.samples:
                layout.sample_rows.append(len(logit_rows))
                logit_rows.append(len(tokens) - 1)
                samplers.append(chunk.seq)
        decode_start = len(tokens)
        tables: list[list[int]] = []
        lens: list[int] = []
        for i, (seq, pos) in enumerate(decode_rows):
            tables.append(place(seq, pos, pos + 1))
            lens.append(pos + 1)
            if i == 0 or decode_rows[i - 1][0] is not seq:
                layout.sample_rows.append(len(logit_rows))
                logit_rows.append(len(tokens) - 1)
                samplers.append(seq)
        longest = max(lens, default=0)
        decode_tables = torch.tensor([padded(t, longest) for t in tables], dtype=torch.long)
        num_keys = decode_tables.shape[1] * bs if tables else 0
        pos_t = torch.tensor(positions)
        batch = ForwardBatch(
            token_ids=torch.tensor(tokens),
            positions=pos_t,
            slot_blocks=torch.tensor(slot_blocks),
            slot_offsets=pos_t % bs,
            prefills=prefills,
            decode_start=decode_start,
            decode_tables=decode_tables,
            decode_masked=decode_mask(torch.tensor(lens, dtype=torch.long), num_keys),
            logit_rows=torch.tensor(logit_rows, dtype=torch.long),
            loras=[(w, torch.tensor(rows, dtype=torch.long)) for w, rows in lora_rows.items()],
        )
        return batch, layout


def _score_prompt_rows(seq: Sequence, start: int, end: int, row0: int,
                       logit_rows: list[int], layout: LogitLayout) -> None:
    """Ask for the logits of a chunk's prompt positions not scored yet (requests with
    prompt log-probabilities): position p's logits score prompt token p + 1."""
    if seq.request.prompt_logprobs is None or seq.prompt_logprobs_sent:
        return
    first = max(start, len(seq.prompt_logprobs))
    last = min(end, len(seq.request.prompt_token_ids) - 1)
    if last <= first:
        return
    layout.prompt_spans.append((seq, len(logit_rows), first, last - first))
    logit_rows.extend(range(row0 + first - start, row0 + last - start))
