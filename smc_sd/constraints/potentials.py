"""genlm-control potentials as token constraints of one language model.

A boolean genlm-control `Potential` over bytes is coerced to the LM's tokens by concatenating
token bytes, as genlm-control's `coerce(llm, f=b"".join)` does:

    phi_tokens(x_1..x_t) = phi_bytes(bytes(x_1) + ... + bytes(x_t)).

Lowering, in order of preference:
- A `Language` (smc_sd.constraints.languages: a regex, Lark grammar or JSON schema compiled to an
  llguidance grammar), `Regex`, `Grammar`, `JsonSchema` (smc_sd.constraints.grammars, the same as
  genlm-control potentials), and genlm-control's `BoolFSA`, `BoolCFG` and `JsonSchema` whose
  language can be read back (smc_sd.constraints.genlm_lowering), become llguidance masks
  (`GrammarConstraint`): exact, tens of microseconds per mask. A schema llguidance only
  over-approximates also yields a `CompletionCheck`, the exact test as phi on complete strings.
  A `Language` is lowered without loading genlm-control; any other constraint loads it.
- A product `p1 * p2` is split into its factors, each lowered on its own and conjoined
  (`ConjunctionConstraint`).
- Any other boolean potential over bytes keeps the generic path, `BytePotentialConstraint`.
- A potential over the LM's own token ids is asked for `batch_logw_next` directly.

Special tokens other than EOS never appear in masks (their text is dropped on decoding).
"""

from __future__ import annotations

import asyncio

import torch

from smc_sd.constraints.byte_masks import PREFIX_BYTES, BoundedTable, PotentialCalls, SpelledVocabulary, batched_masks, mask_table
from smc_sd.constraints.byte_vocabulary import vocabulary_trie
from smc_sd.constraints.token_constraints import ConjunctionConstraint, TokenConstraint
from smc_sd.constraints.scores import BlockPotential


class BytePotentialConstraint(TokenConstraint):
    """Any boolean genlm-control potential over bytes, as token masks of one LM (the generic path).

    The mask of a generated prefix with bytes d allows token v iff prefix(d + bytes(v)) = 0, and
    EOS iff complete(d) = 0 (`smc_sd.constraints.byte_masks`): every new row of a call and every
    token are asked in one `batch_prefix`. Rows are cached by their bytes, for as long as the
    potential and the LM live (every lowering of one potential for one LM shares them).

    Cost: V prefix tests per new prefix (49,152 on the default model); with a vectorised
    `batch_prefix` a mask costs tens of milliseconds, with a Python `prefix` alone about a
    microsecond per token more. Use it for potentials llguidance cannot express; write regexes,
    grammars and schemas as `Regex`, `Grammar` and `JsonSchema` (llguidance, microseconds per mask).

    Args:
        potential: a `Potential` whose vocabulary is bytes (ints 0..255); `prefix` must be 0 on
            every prefix of a string of the language and -inf otherwise, `complete` likewise on
            the strings themselves.
        lm: the language model whose tokens are masked.
    """

    def __init__(self, potential, lm):
        self.potential = potential
        self.vocab_size, self.eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
        self._vocabulary = SpelledVocabulary(lm)
        self._calls = PotentialCalls(potential)
        self._masks = mask_table(potential, lm)
        self._bytes = BoundedTable(PREFIX_BYTES)

    def _data(self, prefix: list[int]) -> bytes:
        """The bytes of a token prefix: its parent's (when kept) plus its last token's."""
        key = tuple(prefix)
        data = self._bytes.get_recent(key)
        if data is None:
            parent = self._bytes.get_recent(key[:-1]) if key else None
            spelled = self._vocabulary.bytes_of
            data = parent + (spelled[key[-1]] or b"") if parent is not None else b"".join(spelled[t] or b"" for t in key)
            self._bytes.put(key, data)
        return data

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        datas = [self._data(prefix) for prefix in prefixes]
        rows = {data: self._masks.get_recent(data) for data in datas}
        new = [data for data, row in rows.items() if row is None]
        if new:
            for data, row in zip(new, batched_masks(self._calls, self._vocabulary, new, self.vocab_size, self.eos)):
                self._masks.put(data, row)
                rows[data] = row
        # [B, V] bool
        return torch.stack([rows[data] for data in datas])


class TokenPotentialConstraint(TokenConstraint):
    """A boolean genlm-control potential whose vocabulary is the LM's token ids 0..V-1 (EOS
    excluded); masks come from one `batch_logw_next` call per batch."""

    def __init__(self, potential, lm):
        self.potential = potential
        self.vocab_size, self.eos = lm.vocabulary.size, lm.vocabulary.eos_token_id
        self._loop = asyncio.new_event_loop()

    def mask(self, prefixes: list[list[int]]) -> torch.Tensor:
        weights = self._loop.run_until_complete(self.potential.batch_logw_next(prefixes)).weights
        # [B, len(vocab) + 1]: the potential's tokens, then its EOS
        logw = torch.as_tensor(weights, dtype=torch.float64)
        out = torch.zeros(len(prefixes), self.vocab_size, dtype=torch.bool)
        out[:, torch.as_tensor(self.potential.vocab, dtype=torch.long)] = logw[:, :-1] > float("-inf")
        out[:, self.eos] = logw[:, -1] > float("-inf")
        return out


def is_byte_potential(potential) -> bool:
    """Whether a genlm-control potential's vocabulary is bytes (ints below 256)."""
    return all(isinstance(v, int) and 0 <= v < 256 for v in potential.vocab)


def as_token_constraint(constraint, lm) -> TokenConstraint:
    """Lower one of a program's constraints to token masks of `lm` (module docstring).

    Args:
        constraint: a `TokenConstraint` (kept), a `Language`, or a boolean genlm-control
            `Potential` over bytes or over the LM's token ids.
        lm: the target LM.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(constraint, TokenConstraint):
        return constraint
    # lowered afresh for every run: what a run's constraint holds (matcher states, mask rows) is
    # freed with the run; what is dear to make is shared by content (compiled grammars) or
    # kept while the potential lives (the generic path's masks)
    return _lower(constraint, lm)


def _lower(constraint, lm) -> TokenConstraint:
    # llguidance loads with the first constraint: an unconstrained run needs none
    from smc_sd.constraints.languages import Language
    from smc_sd.constraints.llguidance_masks import GrammarConstraint

    if isinstance(constraint, Language):
        return GrammarConstraint(constraint.grammar, lm, constraint.description, constraint.exact_check)
    # every other constraint is a genlm-control potential: only now is genlm-control loaded
    from genlm.control.potential import Potential

    from smc_sd.constraints.genlm_lowering import factors, lower

    if not isinstance(constraint, Potential):
        raise TypeError(f"a constraint must be a TokenConstraint, a Language or a genlm-control Potential, got {type(constraint).__name__}")
    if not is_byte_potential(constraint):
        return TokenPotentialConstraint(constraint, lm)
    parts = factors(constraint)
    if len(parts) > 1:
        # p1 * p2: each factor on its own path (llguidance where it can be read back)
        return ConjunctionConstraint(tuple(as_token_constraint(p, lm) for p in parts))
    language = lower(constraint)
    if language is None:
        return BytePotentialConstraint(constraint, lm)
    return GrammarConstraint(language.grammar, lm, language.description, language.exact_check)


class CompletionCheck(BlockPotential):
    """The exact test of an over-approximated grammar as a block-end potential: log phi = 0 on
    prefixes (the masks already test them) and on complete strings that pass, -inf otherwise.

    Args:
        check: bytes -> bool on complete strings.
        lm: the model whose token ids the prefixes hold.
    """

    def __init__(self, check, lm):
        self.check = check
        self._vocabulary = vocabulary_trie(lm)[0]

    def log_score(self, prefixes: list[list[int]], complete: list[bool]) -> torch.Tensor:
        texts = [b"".join(self._vocabulary[t] or b"" for t in p) for p in prefixes]
        return torch.tensor([0.0 if not c or self.check(t) else float("-inf") for t, c in zip(texts, complete)], dtype=torch.float64)


def completion_checks(constraints: tuple[TokenConstraint, ...], lm) -> tuple:
    """The `CompletionCheck`s of lowered constraints whose llguidance grammar only
    over-approximates its source (members of a conjunction included)."""
    out = []
    for constraint in constraints:
        if isinstance(constraint, ConjunctionConstraint):
            out += completion_checks(constraint.members, lm)
        elif getattr(constraint, "exact_check", None) is not None:
            out.append(CompletionCheck(constraint.exact_check, lm))
    return tuple(out)
