"""An hf backend whose head scores a restricted output vocabulary S (|S| = V_S << V).

A draft that scores only S (the shipped distilled draft, `smc_sd.models.draft`) defines

    q(v) = softmax(z)_v for v in S,  q(v) = 0 for v not in S,

where z [V_S] are the head's logits. `RestrictedVocabLM` returns [B, L, V] logits equal to z on S
and `MASKED_LOGIT` elsewhere. MASKED_LOGIT is finite (backends return finite logits) and so far
below any real logit (|z| < 100) that exp underflows to exactly 0 in float32 at any draft
temperature T_d <= 10: the q used in weights and acceptance tests is exactly the distribution the
draft samples from, with q = 0 outside S. (At a higher T_d tokens outside S get a tiny positive q;
the sampler still uses that same q, so the maths stays exact.)
"""

from __future__ import annotations

import torch

from smc_sd.backends.hf import HFLanguageModel

MASKED_LOGIT = -1e4


class RestrictedVocabLM(HFLanguageModel):
    """An `HFLanguageModel` whose head scores only the token ids `vocab_ids`.

    Args:
        model: a transformers causal LM whose `lm_head` maps to V_S = len(vocab_ids) outputs and
            whose `config.vocab_size` is the full V (its input embedding has V rows).
        tokenizer: the target's tokenizer.
        vocab_ids: [V_S] int64, distinct token ids, the support S of q.
        options: passed to `HFLanguageModel` (`kv_cache`, `block_size`).
    """

    def __init__(self, model, tokenizer, vocab_ids: torch.Tensor, **options):
        super().__init__(model, tokenizer, **options)
        self.vocab_ids = vocab_ids.to(device=model.device, dtype=torch.long)

    def _logits(self, cache, **inputs):
        """The head's [B, L, V_S] logits scattered into [B, L, V], MASKED_LOGIT off S."""
        # [B, L, V_S]
        compact = super()._logits(cache, **inputs)
        full = compact.new_full((*compact.shape[:2], self.vocabulary.size), MASKED_LOGIT)
        full[..., self.vocab_ids] = compact
        return full
