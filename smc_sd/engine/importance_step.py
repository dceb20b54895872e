"""One verification step for the SMC-SD rows of every running request at once.

The requests whose plans are importance-verified with a draft LM or none (SMC-SD, and `ar` as
SMC with one particle and K = 0), whose blocks are K drafted tokens and a bonus token, share one
fixed sequence of tensor operations per cycle, whatever their number (`verify_importance_rows`,
whose tensor core is `smc_sd.engine.block_scores.score_rows`):

    scores   = alpha_a · log p_{T_a}(. | row a's prefix)             [A, K + 1, V]
    bonus_a  ~ p_{T_a}^alpha_a · m_a / Z_a   (the constraint's mask m_a; unmasked where Z_a = 0)
    inc[a, k] = scores[a, k, x_k] - log q~_a(x_k)   (k < K),   inc[a, K] = log Z_a
    log w_i  += sum of inc over the columns that count (`smc_sd.engine.smc.block_mask`)

row a belonging to request g(a) with its own temperature T, power alpha, budget and constraint,
exactly as `smc_sd.engine.smc.verify_block` and `advance` compute them for one request. The
bonus draws use uniforms keyed by (request seed, cycle, particle, stream), so a request draws
the same tokens alone or among others (`smc_sd.engine.keyed_random`).

The end of the cycle, ESS, the resampling decision, ancestor draws and log Z_hat steps, is one
call of `resample_rows` per particle count N over every request with N particles
(`resample_groups`), for every SMC-SD request, stepped or not.

The rows come gathered once per cycle (`smc_sd.engine.step_rows.StepRows`), drafted together
when unconstrained. What stays per request: a constrained request's masks and drafts (each
request's constraint object is asked for its rows), and the requests whose particles need
per-prefix Python after the block (stop strings, block-end potentials, a twist) or whose blocks
are a free draft's: they verify with their own `ImportanceGroup.verify`.

Dimension letters: G requests of the step, N_g particles of request g, A unfinished particles
of all of them (the rows), K draft length (one value per step), V vocabulary.
"""

from __future__ import annotations

import torch

from smc_sd.engine import kernels
from smc_sd.engine.drafting import DraftBlock
from smc_sd.engine.keyed_random import BONUS, RESAMPLE
from smc_sd.engine.resampling import resample_rows
from smc_sd.engine.rows import row_logits
from smc_sd.engine.sampling import scaling
from smc_sd.engine.smc import every_particles_block, kept_weight
from smc_sd.engine.step_rows import StepRows


def verify_importance_rows(step: StepRows, packed: torch.Tensor, starts: torch.Tensor, block: DraftBlock, bonus_mask: torch.Tensor | None) -> list[int]:
    """Verify every row's block in one pass of tensor operations and store the result.

    Each row reads its last token and its K drafted tokens in the target pass, so row r's logits
    are packed[starts[r] : starts[r] + K + 1].

    Args:
        step: the requests' rows (`StepRows`), one draft length K.
        packed: [T, V] float32, the target pass's logits row after row; starts: [B + 1] int64.
        block: the cycle's drafted block of every row ([A, K] tokens).
        bonus_mask: [A, V] bool, the bonus token's constraint masks (all allowed on an
            unconstrained request's rows), or None when no request is constrained.

    Returns:
        A_g per request: its particles that were unfinished before the block.

    Writes the table's tokens, length, finished and logw of every request's slots; the requests'
    per-cycle accounting (`ImportanceGroup.end_verify`) and resampling (`resample_groups`) are
    the caller's.
    """
    groups, k, owner = step.groups, step.draft_len, step.owner
    eos = groups[0].eos
    # [A]: the target rows of the unfinished particles
    rows = step.rows_of(step.table.target_row)
    # [A, K + 1, V]: each row's logits after its last token and after each drafted token
    logits = row_logits(packed, starts, rows, k + 1)
    temperatures, alphas = [g.plan.target_temperature for g in groups], [g.plan.alpha for g in groups]
    # [A]: each row's T and alpha (None when every alpha is 1)
    temperature = torch.tensor(temperatures, dtype=torch.float32)[owner]
    powered = torch.tensor([a != 1 for a in alphas])[owner] if any(a != 1 for a in alphas) else None
    alpha = None if powered is None else torch.tensor(alphas, dtype=torch.float32)[owner]
    # [A]: the rows whose bonus normaliser is not 1 by construction: every row of constrained
    # requests (`bonus_mask` is theirs), else the powered ones
    weighted_bonus = torch.ones(owner.numel(), dtype=torch.bool) if bonus_mask is not None else powered
    keys, cores = step.keys, kernels.current()
    u = cores.keyed_uniforms(keys.request_key, keys.cycle, keys.particle, k, BONUS)
    tokens, increments = cores.score_rows(
        logits, temperature, alpha, bonus_mask, block.tokens, block.drawn_logq, block.dead, u, weighted_bonus, 0.0 in temperatures, scaling(temperatures)
    )
    advance_rows(step, tokens, increments, eos)
    return step.unfinished_counts()


def advance_rows(step: StepRows, block: torch.Tensor, increments: torch.Tensor, eos: int) -> None:
    """Append each unfinished particle's block at its request's column and add the columns that
    count to its log weight (`smc_sd.engine.smc.advance` for many requests at once): the columns
    of `block_mask`, with each request's own remaining budget; the tokens kept are the first min(K + 1, budget),
    EOS filler on finished particles.

    Args:
        step: the requests' rows.
        block, increments: [A, K + 1] int64 tokens and float64 log-weight increments.
    """
    groups, table, slots, request, active = step.groups, step.table, step.slots, step.request, step.active
    width = block.shape[1]
    generated = torch.tensor([g.generated for g in groups], dtype=torch.int64)[request]
    budget = torch.tensor([g.plan.max_tokens - g.generated for g in groups], dtype=torch.int64)[request]
    full_block, full_increments, keep = every_particles_block(block, increments, active, eos, budget)
    columns = torch.arange(width)
    within = columns[None, :] < budget[:, None]
    finished = ~active | ((full_block == eos) & keep).any(1)
    table.finished[slots] = finished
    # particles that finished drop their rows
    table.target_row[slots[finished]] = -1
    table.draft_row[slots[finished]] = -1
    table.logw[slots] += kept_weight(keep, full_increments)
    # the kept tokens go to columns generated .. generated + min(K + 1, budget) - 1
    at = (generated[:, None] + columns[None, :])[within]
    table.tokens[slots[:, None].expand(-1, width)[within], at] = full_block[within]
    table.length[slots] = generated + budget.clamp(max=width)


def resample_groups(groups: list, table) -> list[tuple[float, bool, float]]:
    """The end of a cycle for many requests: ESS, the resampling decision (`resample_rows`) and
    ancestors, the requests of equal N in one call, uniforms keyed by (seed, cycle, particle);
    the resampled particles take their ancestors' state in one `SlotTable.copy`. A request of
    one particle (ar) is never resampled: its ESS is 1 while its weight is positive and 0 once
    it is zero, never inside (0, tau · 1), so its outcome is read off its weight, with no draw.

    Args:
        groups: `ImportanceGroup`s whose blocks are stored in `table`.

    Returns:
        per group (ess, resampled, log_z_step, unfinished, ancestors): log_z_step 0.0 when not
        resampled, unfinished its particles that have not finished after the resampling,
        ancestors (N ints) when resampled, else None.
    """
    out: list = [None] * len(groups)
    targets, sources, buckets = [], [], []
    for n in sorted({g.plan.particles for g in groups}):
        members = [i for i, g in enumerate(groups) if g.plan.particles == n]
        # [G_n, N]: the slots of the requests with N particles
        slots = torch.stack([groups[i].slots for i in members])
        buckets.append((members, slots))
        if n == 1:
            for i, alive in zip(members, torch.isfinite(table.logw[slots[:, 0]]).tolist()):
                out[i] = (1.0 if alive else 0.0, False, 0.0, None)
            continue
        request_keys = torch.tensor([groups[i].key for i in members], dtype=torch.int64)[:, None]
        cycles = torch.tensor([len(groups[i].cycles) for i in members], dtype=torch.int64)[:, None]
        u = kernels.current().keyed_uniforms(request_keys, cycles, torch.arange(n)[None, :], 0, RESAMPLE)
        plans = [groups[i].plan for i in members]
        ess, resampled, ancestors, steps = resample_rows(table.logw[slots], torch.tensor([p.ess_threshold for p in plans], dtype=torch.float64), [p.resampling for p in plans], u)
        targets.append(slots[resampled].flatten())
        sources.append(slots.gather(1, ancestors)[resampled].flatten())
        for i, e, r, step, a in zip(members, ess.tolist(), resampled.tolist(), steps.tolist(), ancestors.tolist()):
            out[i] = (e, r, step if r else 0.0, a if r else None)
    moved = torch.cat(targets) if targets else torch.empty(0, dtype=torch.int64)
    if moved.numel():
        table.copy(moved, torch.cat(sources))
    for members, slots in buckets:
        for i, unfinished in zip(members, (~table.finished[slots]).sum(1).tolist()):
            out[i] = (*out[i][:3], unfinished, out[i][3])
    return out
