"""Laws every `LanguageModel` backend must satisfy, as assertions for its tests.

Each function raises AssertionError naming the law and the largest deviation. Logits are compared
raw ([..., V] float32) with an absolute tolerance, so `atol` must cover the backend's numerical
noise between batched and unbatched forwards. That noise depends on the processor's kernels (how
they order and block their sums), so a model's tolerance is derived on the machine that runs the
test: `float32_logit_tolerance` bounds it from the float32 error of a fresh forward against a
float64 forward of the same weights.

The `assert_ragged_*` laws are the same laws over rows of different lengths (rows of several
prompts made by `join`, rolled back by `truncate_rows`), for backends whose rows may differ.

Dimension letters: B rows, T continuation tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from smc_sd.backends.base import LanguageModel, Sequences


def assert_logits_valid(logits: torch.Tensor, what: str = "logits") -> None:
    """Law: logits hold no NaN and no +inf, and every row has a finite entry.

    A backend may return -inf for a token of probability zero (the engine handles it everywhere:
    such a token is never drawn and a weight that needs it becomes zero); temperatures and masks
    belong to the caller.

    Args:
        logits: [..., V] float32.
        what: a name for the message.
    """
    bad = torch.isnan(logits) | (logits == float("inf"))
    if bad.any():
        raise AssertionError(f"{what}: {int(bad.sum())} of {logits.numel()} entries are NaN or +inf")
    empty = ~torch.isfinite(logits).any(-1)
    if empty.any():
        raise AssertionError(f"{what}: {int(empty.sum())} rows have no finite entry (no token can follow)")


def extend_in_chunks(lm: LanguageModel, rows, continuation_rows: torch.Tensor) -> torch.Tensor:
    """Append continuation_rows [B, T] to the rows in chunks of 1, 3 and the rest tokens,
    checking each chunk's logits shape; the logits of every position, [B, T, V] float32."""
    batch, steps = continuation_rows.shape
    chunks, start = [], 0
    for size in (1, 3, steps):
        stop = min(start + size, steps)
        if stop > start:
            logits = rows.extend(continuation_rows[:, start:stop])
            _assert_logits_shape(logits, (batch, stop - start, lm.vocabulary.size), "extend")
            chunks.append(logits)
        start = stop
    return torch.cat(chunks, dim=1)


def assert_extend_matches_full_forward(
    lm: LanguageModel, prompt: list[int], continuation_rows: torch.Tensor, atol: float
) -> None:
    """Law: extend is the autoregressive factorisation, whatever the chunking.

    With rows = open(prompt, B) and the continuation appended in chunks of 1, 3 and the rest
    tokens, for every row b and column t

        extend logits[b, t] == open(prompt + continuation_rows[b, : t + 1], 1) logits,

    the right side being a fresh forward over the whole prefix.

    Args:
        lm: the backend.
        prompt: at least one token id.
        continuation_rows: [B, T] int64, T >= 1; rows may differ.
        atol: the largest allowed absolute difference of any logit.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    batch, steps = continuation_rows.shape
    rows, _ = lm.open(prompt, batch)
    # [B, T, V]
    chunked = extend_in_chunks(lm, rows, continuation_rows)
    if rows.length != len(prompt) + steps:
        raise AssertionError(f"length is {rows.length} after extending, not {len(prompt) + steps}")
    for b in range(batch):
        for t in range(steps):
            prefix = prompt + continuation_rows[b, : t + 1].tolist()
            fresh_rows, fresh = lm.open(prefix, 1)
            fresh_rows.close()
            _assert_close(chunked[b, t], fresh, atol, f"extend row {b} column {t} vs a fresh open")
    rows.close()


def assert_select_consistent(
    lm: LanguageModel,
    prompt: list[int],
    continuation_rows: torch.Tensor,
    ancestors: torch.Tensor,
    atol: float,
) -> None:
    """Law: select(a) then extend equals extending the old rows a[i].

    The continuation's first half makes the rows differ; then, with x its second half,

        (select(a); extend(x[a]))[i] == extend(x)[a[i]]    for every i,

    where the right side extends a second, unselected copy of the rows.

    Args:
        lm: the backend.
        prompt: at least one token id.
        continuation_rows: [B, T] int64, T >= 2.
        ancestors: [B'] int64 in 0 .. B-1; repeats (and B' != B) exercise forking and dropping.
        atol: the largest allowed absolute difference of any logit.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    ancestors = torch.as_tensor(ancestors, dtype=torch.long)
    batch, steps = continuation_rows.shape
    if steps < 2:
        raise ValueError(f"the continuation needs at least 2 tokens, got {steps}")
    half = steps // 2
    before, after = continuation_rows[:, :half], continuation_rows[:, half:]
    reference_rows, _ = lm.open(prompt, batch)
    reference_rows.extend(before)
    # [B, T - half, V]
    reference = reference_rows.extend(after)
    reference_rows.close()

    rows, _ = lm.open(prompt, batch)
    rows.extend(before)
    rows.select(ancestors)
    if rows.batch_size != len(ancestors) or rows.length != len(prompt) + half:
        raise AssertionError(
            f"after select of {len(ancestors)} rows: batch_size {rows.batch_size}, "
            f"length {rows.length} (expected {len(ancestors)}, {len(prompt) + half})"
        )
    # [B', T - half, V]
    selected = rows.extend(after[ancestors])
    rows.close()
    _assert_close(selected, reference[ancestors.to(reference.device)], atol, "extend after select")


def assert_truncate_consistent(
    lm: LanguageModel, prompt: list[int], continuation_rows: torch.Tensor, kept: int, atol: float
) -> None:
    """Law: truncate(n) then extend equals never having appended past n.

    With c = continuation_rows and n = len(prompt) + kept: extend(c[:, :kept]), extend some other
    tokens, truncate(n), then extend(c[:, kept:]) gives the logits that extend(c) gives at
    columns kept .. T-1.

    Args:
        lm: the backend.
        prompt: at least one token id.
        continuation_rows: [B, T] int64.
        kept: continuation tokens kept, 0 <= kept < T.
        atol: the largest allowed absolute difference of any logit.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    batch, steps = continuation_rows.shape
    if not 0 <= kept < steps:
        raise ValueError(f"kept must be in 0 .. {steps - 1}, got {kept}")
    rows, _ = lm.open(prompt, batch)
    # [B, T, V]
    reference = rows.extend(continuation_rows)
    rows.close()

    rows, _ = lm.open(prompt, batch)
    if kept:
        rows.extend(continuation_rows[:, :kept])
    # tokens that must be forgotten: the rest of the continuation, reversed
    rows.extend(continuation_rows[:, kept:].flip(1))
    rows.truncate(len(prompt) + kept)
    if rows.length != len(prompt) + kept:
        raise AssertionError(f"length is {rows.length} after truncate({len(prompt) + kept})")
    # [B, T - kept, V]
    resumed = rows.extend(continuation_rows[:, kept:])
    rows.close()
    _assert_close(resumed, reference[:, kept:], atol, f"extend after truncate to {kept} kept")


def open_ragged(lm: LanguageModel, prompts: list[list[int]], atol: float) -> Sequences:
    """Rows holding prompts[b]: the first opened, each other joined as one more row.

    Law: join(prompt, 1) returns the logits a fresh open(prompt, 1) returns, and `lengths`
    counts every row's own tokens.

    Args:
        prompts: B >= 1 prompts of any lengths (each at least one token).
    """
    rows, _ = lm.open(prompts[0], 1)
    for prompt in prompts[1:]:
        joined = rows.join(prompt, 1)
        fresh_rows, fresh = lm.open(prompt, 1)
        fresh_rows.close()
        _assert_close(joined, fresh, atol, f"join({len(prompt)} tokens) vs a fresh open")
    if rows.lengths.tolist() != [len(p) for p in prompts]:
        raise AssertionError(f"lengths are {rows.lengths.tolist()} after joining prompts of {[len(p) for p in prompts]}")
    return rows


def assert_ragged_extend_matches_full_forward(
    lm: LanguageModel, prompts: list[list[int]], continuation_rows: torch.Tensor, atol: float
) -> None:
    """Law: over rows of different lengths, extend is each row's autoregressive factorisation.

    With rows b holding prompts[b] (`open_ragged`) and the continuation appended in chunks of 1,
    3 and the rest, extend logits[b, t] == open(prompts[b] + continuation_rows[b, : t + 1], 1).

    Args:
        prompts: B prompts of different lengths.
        continuation_rows: [B, T] int64, T >= 1.
        atol: the largest allowed absolute difference of any logit.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    batch, steps = continuation_rows.shape
    rows = open_ragged(lm, prompts, atol)
    # [B, T, V]
    chunked = extend_in_chunks(lm, rows, continuation_rows)
    if rows.lengths.tolist() != [len(p) + steps for p in prompts]:
        raise AssertionError(f"lengths are {rows.lengths.tolist()} after extending by {steps}")
    rows.close()
    for b, prompt in enumerate(prompts):
        for t in range(steps):
            _assert_close(chunked[b, t], fresh_logits(lm, prompt + continuation_rows[b, : t + 1].tolist()), atol, f"ragged extend row {b} column {t}")


def assert_ragged_select_consistent(
    lm: LanguageModel, prompts: list[list[int]], continuation_rows: torch.Tensor, ancestors: torch.Tensor, atol: float
) -> None:
    """Law: over rows of different lengths, select(a) then extend equals extending old rows a[i].

    As `assert_select_consistent`, with rows b holding prompts[b]; the selected rows also carry
    their ancestors' lengths.

    Args:
        prompts: B prompts of different lengths.
        continuation_rows: [B, T] int64, T >= 2.
        ancestors: [B'] int64 in 0 .. B-1.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    ancestors = torch.as_tensor(ancestors, dtype=torch.long)
    half = continuation_rows.shape[1] // 2
    if half < 1:
        raise ValueError(f"the continuation needs at least 2 tokens, got {continuation_rows.shape[1]}")
    before, after = continuation_rows[:, :half], continuation_rows[:, half:]
    reference_rows = open_ragged(lm, prompts, atol)
    reference_rows.extend(before)
    # [B, T - half, V]
    reference = reference_rows.extend(after)
    reference_rows.close()

    rows = open_ragged(lm, prompts, atol)
    rows.extend(before)
    rows.select(ancestors)
    expected = [len(prompts[a]) + half for a in ancestors.tolist()]
    if rows.lengths.tolist() != expected:
        raise AssertionError(f"lengths after select are {rows.lengths.tolist()}, expected {expected}")
    # [B', T - half, V]
    selected = rows.extend(after[ancestors])
    rows.close()
    _assert_close(selected, reference[ancestors.to(reference.device)], atol, "ragged extend after select")


def assert_ragged_truncate_consistent(
    lm: LanguageModel, prompts: list[list[int]], continuation_rows: torch.Tensor, lengths: list[int], atol: float
) -> None:
    """Law: truncate_rows(n) then extend equals never having appended past n, row by row.

    With x_b = prompts[b] + continuation_rows[b]: extend the continuation and then other tokens,
    truncate_rows(lengths), and extend every row by the next L = min_b(|x_b| - lengths[b]) tokens
    of its own x_b; row b, column l must give the logits of a fresh open(x_b[: lengths[b] + l + 1]).
    A length may cut into the prompt, down to 0 (an empty row resumes at position 0).

    Args:
        prompts: B prompts of different lengths.
        continuation_rows: [B, T] int64.
        lengths: B lengths, 0 <= lengths[b] < |x_b|.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    sequences = [p + c for p, c in zip(prompts, continuation_rows.tolist())]
    if not all(0 <= n < len(x) for n, x in zip(lengths, sequences)):
        raise ValueError(f"lengths must lie in 0 .. |x_b| - 1, got {lengths}")
    rows = open_ragged(lm, prompts, atol)
    rows.extend(continuation_rows)
    # tokens that must be forgotten: the continuation again, reversed
    rows.extend(continuation_rows.flip(1))
    rows.truncate_rows(torch.tensor(lengths))
    if rows.lengths.tolist() != list(lengths):
        raise AssertionError(f"lengths are {rows.lengths.tolist()} after truncate_rows({list(lengths)})")
    steps = min(len(x) - n for n, x in zip(lengths, sequences))
    resume = torch.tensor([x[n : n + steps] for n, x in zip(lengths, sequences)])
    # [B, L, V]
    resumed = rows.extend(resume)
    rows.close()
    for b, (n, x) in enumerate(zip(lengths, sequences)):
        for t in range(steps):
            _assert_close(resumed[b, t], fresh_logits(lm, x[: n + t + 1]), atol, f"extend after truncate_rows, row {b} column {t}")


def assert_extend_rows_consistent(
    lm: LanguageModel, prompts: list[list[int]], continuation_rows: torch.Tensor, counts: list[int], atol: float
) -> None:
    """Law: extend_rows(tokens, counts) appends row b's first counts[b] tokens only.

    With rows b holding prompts[b] (`open_ragged`): extend_rows(continuation_rows[:, :L - 1],
    counts) gives [sum(counts), V] logits, entry counts[0] + ... + counts[b - 1] + t ==
    open(prompts[b] + continuation_rows[b, : t + 1]) for t < counts[b]; the rows then hold
    prompts[b] + counts[b] tokens, and extending each by its next token
    (continuation_rows[b, counts[b]]) gives that prefix's fresh logits.

    Args:
        prompts: B prompts of different lengths.
        continuation_rows: [B, L] int64, L >= 2.
        counts: B counts in 0 .. L - 1.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    width = continuation_rows.shape[1] - 1
    rows = open_ragged(lm, prompts, atol)
    # [sum(counts), V]
    logits = rows.extend_rows(continuation_rows[:, :width], torch.tensor(counts))
    _assert_logits_shape(logits, (sum(counts), lm.vocabulary.size), "extend_rows logits")
    if rows.lengths.tolist() != [len(p) + c for p, c in zip(prompts, counts)]:
        raise AssertionError(f"lengths are {rows.lengths.tolist()} after extend_rows with counts {counts}")
    following = continuation_rows[torch.arange(len(prompts)), torch.tensor(counts)]
    # [B, 1, V]
    after = rows.extend(following[:, None])
    rows.close()
    first = 0
    for b, (prompt, count) in enumerate(zip(prompts, counts)):
        for t in range(count):
            _assert_close(logits[first + t], fresh_logits(lm, prompt + continuation_rows[b, : t + 1].tolist()), atol, f"extend_rows row {b} column {t}")
        first += count
        _assert_close(after[b, 0], fresh_logits(lm, prompt + continuation_rows[b, : count + 1].tolist()), atol, f"extend after extend_rows, row {b}")


def assert_join_many_consistent(
    lm: LanguageModel, prompts: list[list[int]], counts: list[int], continuation_rows: torch.Tensor, atol: float
) -> None:
    """Law: join_many is joining the prompts one by one.

    With rows = open(prompts[0], counts[0]) and join_many(prompts[1:], counts[1:]): each
    returned logits row is a fresh open's after its prompt, the rows hold prompts[j] counts[j]
    times in order, and extending every row by continuation_rows gives each row's own
    factorisation (a fresh open over the row's prefix).

    Args:
        prompts: J >= 2 prompts; counts: J row counts.
        continuation_rows: [sum(counts), T] int64.
    """
    continuation_rows = torch.as_tensor(continuation_rows, dtype=torch.long)
    rows, _ = lm.open(prompts[0], counts[0])
    joined = rows.join_many(prompts[1:], counts[1:])
    for j, (prompt, logits) in enumerate(zip(prompts[1:], joined)):
        _assert_close(logits, fresh_logits(lm, prompt), atol, f"join_many prompt {j + 1} vs a fresh open")
    held = [p for p, c in zip(prompts, counts) for _ in range(c)]
    if rows.lengths.tolist() != [len(p) for p in held]:
        raise AssertionError(f"lengths are {rows.lengths.tolist()} after join_many, expected {[len(p) for p in held]}")
    # [B, T, V]
    extended = rows.extend(continuation_rows)
    rows.close()
    for b, prompt in enumerate(held):
        for t in range(continuation_rows.shape[1]):
            _assert_close(extended[b, t], fresh_logits(lm, prompt + continuation_rows[b, : t + 1].tolist()), atol, f"extend after join_many, row {b} column {t}")


def float32_logit_tolerance(model: torch.nn.Module, rows: list[list[int]], spread: float = 2.0) -> float:
    """The absolute tolerance between two float32 evaluations of `model`'s logits over `rows`.

    Let z be a row's exact logits, approximated by a float64 forward of the same weights (its own
    rounding is 2^-29 times smaller), and e = max |f32(z) - z| over every position and token of
    `rows`: the largest error this processor's float32 kernels make on them. Two float32
    evaluations a and b that differ only in the order of their sums (a KV cache, a batch, padding,
    a 1-row kernel against a blocked one) each err by about e, so

        |a - b| <= |a - z| + |z - b| <= 2 * spread * e,

    where `spread` (2) covers kernels whose blocking makes errors up to twice as large as the fresh
    forward's. The bound scales with the logits and with the depth of the sums, on any processor;
    a wrong position, mask or cache entry moves logits by orders of magnitude more.

    Args:
        model: a transformers causal LM in float32 (its `forward(input_ids=...)` returns `.logits`).
        rows: token rows (prompt and continuation) the comparisons will read.
        spread: the ratio allowed between one kernel's largest error and another's.

    Returns:
        2 * spread * e, a positive float.
    """
    import copy

    exact = copy.deepcopy(model).to(torch.float64)
    largest = 0.0
    with torch.no_grad():
        for row in rows:
            # [1, T] one row at a time: no padding enters either forward
            ids = torch.tensor([row])
            error = (model(input_ids=ids).logits.double() - exact(input_ids=ids).logits).abs().max().item()
            largest = max(largest, error)
    del exact
    return 2 * spread * max(largest, torch.finfo(torch.float32).eps)


def fresh_logits(lm: LanguageModel, prefix: list[int]) -> torch.Tensor:
    """[V] next-token logits of a fresh open over `prefix`."""
    rows, logits = lm.open(prefix, 1)
    rows.close()
    return logits


def _assert_logits_shape(logits: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(logits.shape) != shape or logits.dtype != torch.float32:
        raise AssertionError(
            f"{what} returned {tuple(logits.shape)} {logits.dtype}, expected {shape} float32"
        )


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    expected = expected.to(actual.device)
    # equal entries (a -inf logit on both sides included) deviate by 0; a NaN never passes
    deviation = torch.where(actual == expected, 0.0, (actual - expected).abs()).max().item()
    if not deviation <= atol:
        raise AssertionError(f"{what}: logits differ by up to {deviation:.3g} > atol {atol:.3g}")
