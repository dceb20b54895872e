"""A draft backend whose rows read the target's features (`smc_sd.models.feature_draft`).

`FeatureDraftLM(target, model)` pairs with one `HFLanguageModel` target (paged KV): it sets the
target's `feature_layers`, so the target's rows keep F [B, length, m·D] at every position, and
each `open` of the draft pairs its rows with the target rows opened just before on the same
prompt (the engines open the target first). The engines then call `select` and `truncate` on
both alike, so the draft needs nothing more from them.

Letters: B rows, n tokens per row, T = the target rows' length (F_t known for t < T), D width.
Draft position t (reading token x_{t+1}) uses h_t = fuse(F_t) when t < T, else the draft's own
output o_t from position t - 1. A draft row of n tokens holds n - 1 draft positions in its KV.

`extend(tokens)` first re-reads (truncating its KV back to the last position built from true
features) every position the target has read since, now with the true features; then reads the
fed tokens. Positions whose state is a prediction are computed one at a time (each needs the
output of the one before); positions with true features go in one forward. So given the same
target rows, the draft's logits are a function of the tokens alone (the factorisation law), and
every q it returns is the distribution the engine samples from.

Invariants of `FeatureDraftRows`:
- the KV, `outputs` [B, n - 1, D] and `tokens` [B, n] describe the same n - 1 draft positions;
- draft positions 0 .. true - 1 were built from the target's features, true .. n - 2 from the
  draft's own outputs;
- where true features are read, the draft's tokens equal the target rows' tokens (checked).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from smc_sd.backends.base import LanguageModel, Sequences, Vocabulary, check_extend, check_open, check_rows, check_truncate
from smc_sd.backends.hf import HFLanguageModel
from smc_sd.backends.paged_hf import PagedHFSequences
from smc_sd.models.feature_draft import FeatureDraft


class FeatureDraftLM(LanguageModel):
    """A feature-reading draft over the target `target` (an `HFLanguageModel`, paged KV).

    Args:
        target: the target LM these drafts pair with.
        model: the `FeatureDraft` over the target's modules.

    Raises:
        ValueError: if the target is not an hf model with kv_cache='paged', or already keeps
            other features.
    """

    def __init__(self, target, model: FeatureDraft):
        if not isinstance(target, HFLanguageModel) or target.kv_cache != "paged":
            raise ValueError(
                "a feature draft reads the target's hidden states, which only the hf backend's paged rows keep "
                f"(kv_cache='paged'); got {type(target).__name__}"
                + (f" with kv_cache={target.kv_cache!r}" if isinstance(target, HFLanguageModel) else "")
            )
        kept = getattr(target, "feature_layers", None)
        if kept is not None and tuple(kept) != model.feature_layers:
            raise ValueError(f"the target already keeps the features of layers {kept}, this draft reads {model.feature_layers}")
        target.feature_layers = model.feature_layers
        self.target, self.model = target, model.eval()
        self.tokenizer = target.tokenizer

    @property
    def vocabulary(self) -> Vocabulary:
        return self.target.vocabulary

    @property
    def max_length(self) -> int:
        return self.target.max_length

    def open(self, prompt: list[int], batch_size: int) -> tuple[Sequences, torch.Tensor]:
        """Start B draft rows paired with the target rows opened last, on this same prompt.

        Returns:
            The rows and q's logits after the prompt, [V] float32.

        Raises:
            ValueError: if the target's last opened rows are closed or hold another prompt or B.
        """
        check_open(prompt, batch_size, self.max_length)
        target_rows = getattr(self.target, "latest_rows", None)
        prompt_ids = torch.tensor([prompt])
        if (
            not isinstance(target_rows, PagedHFSequences)
            or target_rows._table.closed
            or target_rows.batch_size != batch_size
            or target_rows.length != len(prompt)
            or not torch.equal(target_rows.tokens, prompt_ids.expand(batch_size, -1))
        ):
            raise ValueError(
                "a feature draft's rows pair with the target's rows opened just before on the same prompt "
                "and batch size: open the target first"
            )
        rows = FeatureDraftRows(self.model, target_rows, prompt_ids[:, :1].expand(batch_size, -1).clone())
        logits = rows.extend(prompt_ids[:, 1:].expand(batch_size, -1)) if len(prompt) > 1 else None
        if logits is None:
            # a one-token prompt: the draft has no position to run; q is its state h_0 through the head
            with torch.inference_mode():
                logits = self.model.logits(self.model.hidden(target_rows.features[:, -1:]))
            logits = logits.clone()
        return rows, logits[0, -1]


class FeatureDraftRows(Sequences):
    """B rows of a `FeatureDraftLM`, paired with the target's rows `target_rows`.

    Args:
        model: the draft model.
        target_rows: the target's paged rows (they keep features).
        tokens: [B, 1] int64, the first token of every row.
    """

    def __init__(self, model: FeatureDraft, target_rows: PagedHFSequences, tokens: torch.Tensor):
        self._model, self._target_rows = model, target_rows
        self._device = next(model.parameters()).device
        self._cache: DynamicCache | None = DynamicCache()
        self._tokens = tokens
        width = model.target_config.hidden_size
        # [B, n - 1, D] the draft's outputs o_{t+1} at every draft position t, in its dtype
        self._outputs = torch.empty(tokens.shape[0], 0, width, dtype=next(model.parameters()).dtype, device=self._device)
        # draft positions built from the target's true features
        self._true = 0

    @property
    def batch_size(self) -> int:
        return self._tokens.shape[0]

    @property
    def length(self) -> int:
        return self._tokens.shape[1]

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, L] int64 to every row; return logits [B, L, V] float32.

        Raises:
            ValueError: on a bad shape, if the target rows have another B, or if they hold
                other tokens where their features would be read.
        """
        self._check_open()
        check_extend(tokens, self.batch_size, self.length, self.max_length)
        target = self._target_rows
        if target.batch_size != self.batch_size:
            raise ValueError(f"the target rows hold {target.batch_size} rows, the draft {self.batch_size}: select both alike")
        known = target.length
        positions = self.length - 1
        new = positions + tokens.shape[1]
        # re-read the positions built from the draft's own outputs that the target has read since
        start = self._true if self._true < min(known, positions) else positions
        true_stop = min(known, new)
        tokens = torch.cat([self._tokens, tokens.cpu().long()], 1)
        if true_stop > start and not torch.equal(tokens[:, :true_stop], target.tokens[:, :true_stop]):
            raise ValueError("the draft's rows and the target's rows hold different tokens: select and truncate both alike")
        if start < positions:
            self._cut(start)
        self._true = max(self._true if start == positions else start, true_stop)
        self._tokens = tokens
        with torch.inference_mode():
            if true_stop > start:
                # draft positions start .. true_stop - 1 read x_{t+1} with the true h_t
                self._read(start, true_stop, self._model.hidden(target.features[:, start:true_stop].to(self._device)))
            for t in range(max(start, true_stop), new):
                # past the target's features: h_t is the draft's own output at t - 1
                self._read(t, t + 1, self._outputs[:, t - 1 : t])
            # [B, L, V]
            logits = self._model.logits(self._outputs[:, positions:])
        return logits.clone()

    def select(self, rows: torch.Tensor) -> None:
        """Make row i a copy of old row rows[i] (KV, outputs and tokens)."""
        self._check_open()
        check_rows(rows, self.batch_size)
        with torch.inference_mode():
            self._cache.batch_select_indices(rows.to(self._device))
        self._outputs, self._tokens = self._outputs[rows.to(self._device)], self._tokens[rows.cpu()]

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of every row (draft positions 0 .. length - 2)."""
        self._check_open()
        check_truncate(length, self.length)
        self._cut(length - 1)
        self._tokens = self._tokens[:, :length]
        self._true = min(self._true, length - 1)

    def close(self) -> None:
        self._cache = None

    @property
    def max_length(self) -> int:
        return self._model.target_config.max_position_embeddings

    def _read(self, start: int, stop: int, hidden: torch.Tensor) -> None:
        """Run draft positions start .. stop - 1 (hidden [B, stop - start, D]) and keep their outputs."""
        tokens = self._tokens[:, start + 1 : stop + 1].to(self._device)
        self._outputs = torch.cat([self._outputs, self._model.step(tokens, hidden, start, self._cache)], 1)

    def _cut(self, positions: int) -> None:
        """Keep draft positions 0 .. positions - 1 in the KV and outputs."""
        if positions < self._outputs.shape[1]:
            with torch.inference_mode():
                # a negative argument is the number of positions to remove
                self._cache.crop(positions - self._outputs.shape[1])
        self._outputs = self._outputs[:, :positions]

    def _check_open(self) -> None:
        if self._cache is None:
            raise ValueError("these sequences were closed")
