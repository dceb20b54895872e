"""The llama.cpp backend on the shipped GGUF: token ids, the backend laws, the cell trie, limits.

Run with the llama extra installed: `python -m pytest tests/llama -m llama` (docs/backends.md).
"""

import pytest
import torch

from smc_sd import testing
from smc_sd.backends.base import ContextOverflowError, TokenizerMismatchError
from smc_sd.backends.hf import chat_prompt, vocabulary_fingerprint

pytestmark = [pytest.mark.llama, pytest.mark.model]

QUESTION = "What is the capital of France? Answer in one sentence."


#: The laws' tolerance on the shipped Q4_1 file, one thread: 0. Each law compares two evaluations
#: of the same positions in batches of other shapes and with the rows' cells elsewhere in the
#: cache; on this backend both run the same floating-point operations in the same order:
#: - a Q4_1 (or Q8_0) matrix product computes every output element as one dot product of a weight
#:   row with that token's own activations rounded to 8 bits, whatever else is in the batch;
#: - flash attention computes each query alone over its own sequence's cells in cache order, and
#:   the backend keeps every sequence's cells in position order (`LlamaCppLanguageModel.park`);
#: so the logits are the same bits. Any deviation is a wrong cell, position or mask, or one of
#: the two facts failing (another llama.cpp, for instance).
LAW_ATOL = 0.0
#: TV between the shipped Q4_1 file's next-token distribution on this backend and the hf
#: backend's float32 one (the same 4-bit weights dequantized, activations unrounded): measured
#: 0.05 after the chat prompt below
HF_TV = 0.1
#: TV between llama.cpp's Q4_0 copy of the shipped Q4_1 file (the 4-bit weights rounded again,
#: without Q4_1's per-block offset) and the hf backend's float32 model: measured 0.24 after the
#: chat prompt below; a copy of another model would be near 1
COPY_TV = 0.35


@pytest.fixture(scope="module")
def tokenizer(llama_lm):
    return llama_lm.tokenizer


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return chat_prompt(tokenizer, QUESTION)


@pytest.fixture(scope="module")
def continuation_rows(tokenizer):
    """[3, 6] int64: a natural reply, the same reply shifted, and a row of arbitrary token ids."""
    reply = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    return torch.tensor([reply[:6], reply[1:7], [17, 4000, 912, 33, 18000, 5]])


@pytest.fixture(scope="module")
def atol():
    return LAW_ATOL


def test_token_ids_are_the_ggufs(llama_lm, tokenizer, prompt):
    """The tokenizer the engine uses gives the GGUF's own ids: equal vocabularies, and llama.cpp's
    own tokenizer splits the chat prompt into the same ids."""
    import llama_cpp

    assert vocabulary_fingerprint(tokenizer) == llama_lm.vocabulary.fingerprint
    assert llama_lm.vocabulary.size == len(tokenizer) == 49152
    assert llama_lm.vocabulary.eos_token_id == tokenizer.eos_token_id
    text = tokenizer.decode(prompt)
    buffer = (llama_cpp.llama_token * 512)()
    count = llama_cpp.llama_tokenize(llama_cpp.llama_model_get_vocab(llama_lm._model), text.encode(), len(text.encode()), buffer, 512, False, True)
    assert list(buffer[:count]) == prompt


def test_a_tokenizer_of_other_ids_is_refused(llama_lm, tmp_path):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")))
    with pytest.raises(TokenizerMismatchError, match="token ids differ"):
        LlamaCppLanguageModel(llama_lm.path, tokenizer=other, n_seq_max=1)


def test_logits_are_valid_and_near_the_hf_backends(llama_lm, prompt):
    """The shipped file within HF_TV of the hf backend's float32 model, its Q4_0 copy within
    COPY_TV."""
    from smc_sd.backends.hf import HFLanguageModel
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    reference = testing.fresh_logits(HFLanguageModel.default(dtype="float32"), prompt).softmax(-1)
    copy = LlamaCppLanguageModel.default("q4_0", n_seq_max=2, n_threads=1)
    for lm, bound in ((llama_lm, HF_TV), (copy, COPY_TV)):
        rows, logits = lm.open(prompt, 2)
        rows.close()
        assert logits.shape == (49152,) and logits.dtype == torch.float32
        testing.assert_logits_valid(logits)
        tv = 0.5 * float((logits.softmax(-1) - reference).abs().sum())
        assert tv < bound, (lm.weight_format, tv)


def test_extend_matches_full_forward(llama_lm, prompt, continuation_rows, atol):
    testing.assert_extend_matches_full_forward(llama_lm, prompt, continuation_rows, atol)


# "shrink" drops row 0, whose cells lie below the others': the case that broke the logits before
# freed cells were parked (`LlamaCppLanguageModel.park`)
@pytest.mark.parametrize("ancestors", [[1, 1, 0], [2, 2], [0, 1, 2, 2, 1]], ids=["fork", "shrink", "grow"])
def test_select_consistent(llama_lm, prompt, continuation_rows, ancestors, atol):
    testing.assert_select_consistent(llama_lm, prompt, continuation_rows, torch.tensor(ancestors), atol)


@pytest.mark.parametrize("kept", [0, 3])
def test_truncate_consistent(llama_lm, prompt, continuation_rows, kept, atol):
    testing.assert_truncate_consistent(llama_lm, prompt, continuation_rows, kept, atol)


def test_ragged_laws(llama_lm, tokenizer, prompt, continuation_rows, atol):
    """Rows of three prompts of different lengths: extend, select and truncate_rows (down to an
    empty row), and join_many, each against fresh decodes."""
    prompts = [prompt, chat_prompt(tokenizer, "Hi"), tokenizer.encode("Once upon a time", add_special_tokens=False)]
    testing.assert_ragged_extend_matches_full_forward(llama_lm, prompts, continuation_rows, atol)
    testing.assert_ragged_select_consistent(llama_lm, prompts, continuation_rows, torch.tensor([2, 0, 2, 1]), atol)
    testing.assert_ragged_truncate_consistent(llama_lm, prompts, continuation_rows, [len(prompt) + 2, 3, 0], atol)
    rows = torch.cat([continuation_rows, continuation_rows[:2]])
    testing.assert_join_many_consistent(llama_lm, prompts, [1, 2, 2], rows, atol)
    testing.assert_extend_rows_consistent(llama_lm, prompts, continuation_rows, [3, 0, 5], atol)


def test_copies_gaining_the_same_tokens_are_decoded_once(llama_lm, prompt, continuation_rows, atol, monkeypatch):
    """Rows holding the same cells (the prompt's, or a resampled row's) that gain the same tokens
    share one decode of them and its cells; every row's logits are still the bits of a fresh
    decode of its own tokens."""
    decoded = []
    run = llama_lm.run
    monkeypatch.setattr(llama_lm, "run", lambda tokens, *rest: decoded.append(len(tokens)) or run(tokens, *rest))
    p = len(prompt)
    reply, other = continuation_rows[0].tolist(), continuation_rows[2].tolist()
    rows, _ = llama_lm.open(prompt, 4)
    # rows 0 and 1: the same 3 tokens; row 2: their first 2 only; row 3: others
    tokens = torch.tensor([reply[:3], reply[:3], reply[:3], other[:3]])
    counts = torch.tensor([3, 3, 2, 3])
    logits = rows.extend_rows(tokens, counts)
    assert decoded[-1] == 3 + 2 + 3 and rows.memory()["live_blocks"] == p + 8
    expected = [prompt + tokens[b, : t + 1].tolist() for b in range(4) for t in range(int(counts[b]))]
    for entry, prefix in zip(logits, expected, strict=True):
        torch.testing.assert_close(entry, testing.fresh_logits(llama_lm, prefix), atol=atol, rtol=0)
    # rows 1 and 2 become copies of old row 1 (cells shared with row 0) and gain the same token
    rows.select(torch.tensor([0, 1, 1, 3]))
    after = rows.extend(torch.tensor([[reply[3]], [reply[4]], [reply[4]], [other[3]]]))
    # row 2's own 2 cells are gone (rows 0, 1, 2 share 3 cells, row 3 holds 3); each of the 3
    # decoded tokens adds a cell
    assert decoded[-1] == 3 and rows.memory()["live_blocks"] == p + 6 + 3
    for b, last in enumerate([reply[3], reply[4], reply[4], other[3]]):
        prefix = prompt + (other[:3] if b == 3 else reply[:3]) + [last]
        torch.testing.assert_close(after[b, 0], testing.fresh_logits(llama_lm, prefix), atol=atol, rtol=0, msg=f"row {b} after select")
    rows.close()
    assert llama_lm.trie.live == 0


def test_cells_in_use_follow_the_token_trie(llama_lm, prompt):
    """The prompt's cells are shared by every row; a fork shares the parent's cells; truncation
    and closing return them (counts in cells: blocks of one position)."""
    p = len(prompt)
    rows, _ = llama_lm.open(prompt, 4)
    assert rows.memory()["live_blocks"] == p
    # rows 0 and 1 hold the same cells and gain the same tokens: they share the new cells too
    rows.extend(torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 4], [5, 2, 3]]))
    assert rows.memory()["live_blocks"] == p + 9
    rows.select(torch.tensor([0, 0, 0, 0]))
    # the dropped rows' own tails are freed; the copies share row 0's cells
    assert rows.memory()["live_blocks"] == p + 3
    rows.extend(torch.tensor([[4], [5], [6], [7]]))
    assert rows.memory()["live_blocks"] == p + 3 + 4
    rows.truncate_rows(torch.tensor([p + 1, p + 4, p, p]))
    assert rows.memory()["live_blocks"] == p + 1 + 3 - 1 + 1
    memory = rows.memory()
    assert memory["block_size"] == 1 and memory["peak_bytes"] == (p + 9) * llama_lm.cell_bytes
    assert memory["naive_peak_bytes"] == 4 * (p + 4) * llama_lm.cell_bytes
    rows.close()
    assert llama_lm.trie.live == 0
    rows.close()
    with pytest.raises(ValueError, match="closed"):
        rows.extend(torch.tensor([[1]]))


def test_sequences_past_the_context_are_refused(llama_lm, prompt):
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    # llama.cpp's 256 sequences, one kept by the backend for parked cells
    with pytest.raises(ValueError, match=r"holds 1 \.\. 255 rows"):
        LlamaCppLanguageModel(llama_lm.path, tokenizer=llama_lm.tokenizer, n_seq_max=256)
    rows, _ = llama_lm.open(prompt, 16)
    with pytest.raises(ValueError, match="of this context's 16"):
        rows.select(torch.zeros(17, dtype=torch.int64))
    # the refused select changed nothing
    assert rows.batch_size == 16 and llama_lm.trie.live == len(prompt)
    rows.close()


def test_a_full_cache_is_a_clear_error(llama_lm, prompt):
    from smc_sd.backends.llama_cpp import LlamaCppLanguageModel

    small = LlamaCppLanguageModel(llama_lm.path, tokenizer=llama_lm.tokenizer, n_seq_max=4, n_cells=256)
    rows, _ = small.open(prompt, 4)
    with pytest.raises(ContextOverflowError):
        for _ in range(100):
            rows.extend(torch.full((4, 8), 17))
    rows.close()
