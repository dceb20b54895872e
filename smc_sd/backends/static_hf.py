"""Rows of a transformers model whose KV lives in fixed-shape buffers: the static, compilable path.

`StaticHFSequences` keeps B rows of equal length in one `StaticKV`: per layer, keys and values
[B, H, S, D] (S = capacity, positions sized ahead for the run) and a 0-dim int64 `start` on the
model's device. A forward appending L tokens to rows of length n:

1. `start` is set to n (a host-to-device write of one scalar, not a sync);
2. every layer writes its new keys and values at positions n .. n+L-1 (`index_copy_` along S)
   and attends over all S positions under the additive mask
       mask[l, s] = 0 if s <= n + l else finfo.min,
   so positions past the row's end (never written, or left over from a truncation) get weight 0;
3. the logits [B, L, V] come back as float32.

Every tensor in that forward has a shape fixed by (B, L, S) alone and `start` is read on the
device, so a compiled step never depends on the rows' length (`torch.compile`: on CUDA with
mode "reduce-overhead", which captures one CUDA graph per (B, L, S); on CPU without graphs). The
prompt's forward (one per run, its length varies) runs eagerly.

`select(rows)` is a row gather on the device, `buffer[:, :, :n] = buffer.index_select(0, rows)`
for every layer's keys and values: it copies B · n positions of KV bytes, unlike the paged cache,
which copies block ids. `truncate(m)` only sets the length to m: the positions past m are
masked until a later forward overwrites them.

Buffers are reused: a model keeps the `StaticKV` of closed rows and hands them to the next open
of the same (B, S), so their addresses stay fixed across runs (a captured CUDA graph reads and
writes them in place). Shape changes allocate new buffers (and may compile again): a `select`
to B' != B rows, and an extend past the capacity S (which grows to round_up(max(2S, needed))).

Invariants of `StaticHFSequences`: 1 <= length <= capacity; every buffer has batch_size rows and
capacity positions; after `close()` the buffers are back with the model and other methods raise.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from smc_sd.backends.base import Sequences, check_extend, check_rows, check_truncate

# the capacity S is a multiple of this, so prompts of similar length share buffers and graphs
CAPACITY_STEP = 128
# positions past the prompt a run may use before its buffers must grow
DEFAULT_HEADROOM = 256
# compilations of the step one process may make: torch counts them per function, over all models
# and shapes (its default of 8 is fewer than a sweep over N and K with two models needs)
MAX_COMPILED_SHAPES = 64


def round_up(n: int, step: int = CAPACITY_STEP) -> int:
    return -(-n // step) * step


class StaticLayer(CacheLayerMixin):
    """One attention layer's [B, H, S, D] keys and values, written at start .. start+L-1."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.start = keys, values, start
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """Nothing to allocate: the buffers exist before the first forward."""

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new KV [B, H, L, D] at positions start + (0 .. L-1); return all S positions."""
        positions = self.start + torch.arange(key_states.shape[2], device=key_states.device)
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.start

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticKV:
    """Fixed-shape KV buffers of B rows of one model: per layer keys and values [B, H, S, D].

    Args:
        config: the model's transformers config (layers, key-value heads, head size).
        batch_size: B.
        capacity: S, positions per row.
        dtype, device: of the KV.
    """

    def __init__(self, config, batch_size: int, capacity: int, dtype: torch.dtype, device):
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shape = (batch_size, heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        # [] int64: the first position the next forward writes
        self.start = torch.zeros((), dtype=torch.int64, device=device)
        for tensor in (*self.keys, *self.values, self.start):
            # fixed data pointers: compiled graphs (and CUDA graphs) may mutate them in place
            torch._dynamo.mark_static_address(tensor)
        self.batch_size, self.capacity = batch_size, capacity
        # KV bytes of one position of one row: keys and values of every layer
        self.bytes_per_position = 2 * len(self.keys) * heads * head_dim * self.keys[0].element_size()
        # one Cache object for the life of the buffers, so compiled graphs see the same inputs
        self.cache = Cache(layers=[StaticLayer(k, v, self.start) for k, v in zip(self.keys, self.values)])

    def first_row_cache(self) -> Cache:
        """A Cache over row 0 only ([1, H, S, D] views), for the prompt's batch-1 forward."""
        return Cache(layers=[StaticLayer(k[:1], v[:1], self.start) for k, v in zip(self.keys, self.values)])

    def broadcast_first_row(self, length: int) -> None:
        """Copy row 0's first `length` positions into every other row."""
        for buffer in (*self.keys, *self.values):
            buffer[1:, :, :length] = buffer[:1, :, :length]

    def gather_rows(self, rows: torch.Tensor, length: int, into: StaticKV) -> None:
        """into's row i := this row rows[i] at positions 0 .. length-1 (into may be self).

        Args:
            rows: [B'] int64 on the buffers' device, B' = into.batch_size.
        """
        for source, target in zip((*self.keys, *self.values), (*into.keys, *into.values)):
            # index_select makes the gathered copy first, so into = self is safe
            target[:, :, :length] = source[:, :, :length].index_select(0, rows)


def causal_mask(start: torch.Tensor, length: int, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, L, S] additive mask: 0 where s <= start + l, finfo(dtype).min elsewhere."""
    device = start.device
    # [L, S]: query l (at position start + l) may read key position s
    allowed = torch.arange(capacity, device=device)[None, :] <= start + torch.arange(length, device=device)[:, None]
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def static_forward(
    model, tokens: torch.Tensor, cache: Cache, start: torch.Tensor, cache_kwarg: str, cache_position: bool
) -> torch.Tensor:
    """One fixed-shape forward: append tokens at positions start .. start+L-1 of every row.

    This function is what `torch.compile` compiles; everything it reads is a tensor whose shape
    depends on (B, L, S) only.

    Args:
        model: a transformers `*ForCausalLM`.
        tokens: [B, L] int64 on the model's device.
        cache: the rows' Cache of `StaticLayer`s ([B, H, S, D] each).
        start: [] int64, the rows' current length.
        cache_kwarg: the forward's name of its cache argument.
        cache_position: whether the forward takes `cache_position` (transformers before 5.20,
            which would otherwise derive it from the cache on the host).

    Returns:
        [B, L, V] float32 logits.
    """
    length, capacity = tokens.shape[1], cache.layers[0].keys.shape[2]
    # [1, L]: the same positions for every row
    positions = (start + torch.arange(length, device=tokens.device))[None]
    mask = causal_mask(start, length, capacity, model.dtype)
    options = {cache_kwarg: cache, **({"cache_position": positions[0]} if cache_position else {})}
    out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True, **options)
    return out.logits.float()


class StaticRuntime:
    """A model's static-path state: its forward step (compiled or not) and its free buffers.

    Args:
        model: a transformers `*ForCausalLM`.
        cache_kwarg: the forward's name of its cache argument.
        compile: run `static_forward` through `torch.compile` (CUDA: mode "reduce-overhead", one
            CUDA graph per (B, L, S); CPU: mode "default", no graphs); the prompt stays eager.
            Shapes are automatically dynamic: the first (B, L) compiles a static graph, the first
            other L (or B) recompiles once with that size symbolic, so the step compiles a few
            times in all, not once per shape.
    """

    def __init__(self, model, cache_kwarg: str, compile: bool = False):
        self.model, self.cache_kwarg = model, cache_kwarg
        self.cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.step = static_forward
        if compile:
            graphs = model.device.type == "cuda"
            compiled = torch.compile(static_forward, mode="reduce-overhead" if graphs else "default", fullgraph=True)

            def step(*args):
                if graphs:
                    # the previous replay's outputs were copied out: the graphs may overwrite them
                    torch.compiler.cudagraph_mark_step_begin()
                with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES):
                    return compiled(*args)

            self.step = step
        # (B, S) -> buffers of closed rows, ready for the next open of that shape
        self._free: dict[tuple[int, int], list[StaticKV]] = {}

    def forward(self, tokens: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """[B, L, V] float32 logits of the step appending tokens [B, L] at kv.start (a fresh tensor)."""
        logits = self.step(self.model, tokens, kv.cache, kv.start, self.cache_kwarg, self.cache_position)
        # a CUDA graph's output is overwritten by its next replay: copy it out
        return logits.clone()

    def take(self, batch_size: int, capacity: int) -> StaticKV:
        """Buffers of B rows and S positions: a free set of that shape, or new ones."""
        free = self._free.get((batch_size, capacity))
        if free:
            return free.pop()
        model = self.model
        return StaticKV(model.config, batch_size, capacity, model.dtype, model.device)

    def give_back(self, kv: StaticKV) -> None:
        self._free.setdefault((kv.batch_size, kv.capacity), []).append(kv)


class StaticHFSequences(Sequences):
    """B equal-length rows of an `HFLanguageModel` in one `StaticKV`."""

    def __init__(self, runtime: StaticRuntime, kv: StaticKV, length: int, max_length: int):
        self._runtime, self._kv, self._length, self._max_length = runtime, kv, length, max_length
        self._peak_bytes = self._allocated_bytes()
        self._naive_peak_bytes = kv.batch_size * length * kv.bytes_per_position

    @classmethod
    def open(
        cls, runtime: StaticRuntime, prompt: list[int], batch_size: int, max_length: int, static_length: int | None = None
    ) -> tuple[StaticHFSequences, torch.Tensor]:
        """Compute the prompt once into row 0 (eagerly), then copy its KV into every row.

        Args:
            max_length: the model's context window (positions).
            static_length: S, positions per row to allocate; None for
                round_up(len(prompt) + DEFAULT_HEADROOM). Rows that outgrow S move to larger buffers.

        Returns:
            The rows and the next-token logits after the prompt, [V] float32.

        Raises:
            ValueError: if static_length leaves no position after the prompt.
        """
        capacity = static_length or round_up(len(prompt) + DEFAULT_HEADROOM)
        if capacity < len(prompt) + 1:
            raise ValueError(f"static_length {capacity} leaves no position after a {len(prompt)}-token prompt")
        kv = runtime.take(batch_size, capacity)
        try:
            tokens = torch.tensor([prompt], dtype=torch.long, device=runtime.model.device)
            with torch.inference_mode():
                kv.start.fill_(0)
                # [1, P, V]
                logits = static_forward(
                    runtime.model, tokens, kv.first_row_cache(), kv.start, runtime.cache_kwarg, runtime.cache_position
                )
                kv.broadcast_first_row(len(prompt))
        except BaseException:
            runtime.give_back(kv)
            raise
        return cls(runtime, kv, len(prompt), max_length), logits[0, -1].clone()

    @property
    def batch_size(self) -> int:
        return self._open_kv().batch_size

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        """S, positions per row the buffers hold."""
        return self._open_kv().capacity

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] int64 to every row; return logits [B, L, V] float32.

        Runs the model's compiled step when the model was made with `compile=True`.
        """
        kv = self._open_kv()
        check_extend(tokens, kv.batch_size, self._length, self._max_length)
        device = self._runtime.model.device
        needed = self._length + tokens.shape[1]
        if needed > kv.capacity:
            kv = self._move(torch.arange(kv.batch_size, device=device), round_up(max(2 * kv.capacity, needed)))
        tokens = tokens.to(device=device, dtype=torch.long)
        with torch.inference_mode():
            kv.start.fill_(self._length)
            logits = self._runtime.forward(tokens, kv)
        self._length = needed
        self._naive_peak_bytes = max(self._naive_peak_bytes, kv.batch_size * needed * kv.bytes_per_position)
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i]: a row gather of the KV on the device.

        rows is [B'] int64; B' = B gathers in place (the buffers keep their addresses), B' != B
        moves the rows into buffers of B' rows.
        """
        kv = self._open_kv()
        check_rows(rows, kv.batch_size)
        rows = rows.to(device=self._runtime.model.device, dtype=torch.long)
        if rows.numel() == kv.batch_size:
            with torch.inference_mode():
                kv.gather_rows(rows, self._length, kv)
        else:
            self._move(rows, kv.capacity)

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions of every row: a change of length, nothing is copied."""
        self._open_kv()
        check_truncate(length, self._length)
        self._length = length

    def close(self) -> None:
        if self._kv is not None:
            self._runtime.give_back(self._kv)
            self._kv = None

    def memory(self) -> dict:
        """Bytes of the buffers (B rows x S positions, allocated ahead) and of per-row copies of the
        positions in use (`naive_peak_bytes`, the peak of B x length)."""
        live = 0 if self._kv is None else self._allocated_bytes()
        return {"live_bytes": live, "peak_bytes": self._peak_bytes, "naive_peak_bytes": self._naive_peak_bytes}

    def check_invariants(self) -> None:
        kv = self._open_kv()
        assert 1 <= self._length <= kv.capacity, f"length {self._length} outside 1 .. {kv.capacity}"
        for buffer in (*kv.keys, *kv.values):
            assert buffer.shape[0] == kv.batch_size and buffer.shape[2] == kv.capacity, tuple(buffer.shape)

    def _move(self, rows: torch.Tensor, capacity: int) -> StaticKV:
        """Gather rows [B'] into buffers of B' rows and `capacity` positions; return them."""
        old = self._kv
        new = self._runtime.take(rows.numel(), capacity)
        with torch.inference_mode():
            old.gather_rows(rows, self._length, new)
        self._runtime.give_back(old)
        self._kv = new
        self._peak_bytes = max(self._peak_bytes, self._allocated_bytes())
        self._naive_peak_bytes = max(self._naive_peak_bytes, new.batch_size * self._length * new.bytes_per_position)
        return new

    def _allocated_bytes(self) -> int:
        return self._kv.batch_size * self._kv.capacity * self._kv.bytes_per_position

    def _open_kv(self) -> StaticKV:
        if self._kv is None:
            raise ValueError("these sequences were closed")
        return self._kv
