"""The one place smc-sd reaches into vLLM's internals: reading full raw logit rows in the worker.

vLLM's public API gives next-token log-probabilities as top-k dictionaries, and prompt
log-probabilities only for requests that skip the prefix cache (vLLM 0.32.0's
`SamplingParams.__post_init__` sets `skip_reading_prefix_cache` whenever `prompt_logprobs` is
set), so every cycle would recompute the whole context. Instead this module wraps the V1 model
runner's `_model_forward`: after each forward it reads the hidden states of the positions smc-sd
asked for and applies the model's own `compute_logits` (the LM head, raw logits, no temperature).

Contract with the worker (installed and read through `LLM.collective_rpc`, so it also runs in
every tensor-parallel worker process, where `compute_logits` is a collective):
- `install(worker)` wraps the runner once;
- `want_last(worker, L)`: from now on, for every scheduled request with prompt x_1..x_n (the
  request's whole token list: smc-sd's requests generate one token), capture the raw next-token
  logits after the token at every scheduled 0-based position p >= n - L;
- `take(worker)` returns and clears {tuple(x_1..x_n): {p: logits [V] float32}}.
Positions that vLLM served from its prefix cache are not scheduled and therefore not captured;
the caller asks again for them with shorter requests (see `VLLMLanguageModel.logits_after`).
The wrapper also replaces the model's `compute_logits` by one that returns the rows it has just
computed when vLLM asks for the same hidden states (each request's last token, to sample from),
so the LM head runs once per position, not twice.

Supported: vLLM 0.32.0 with the V1 model runner (`GPUModelRunner` and its `CPUModelRunner`
subclass). `check_supported` names what changed when internals move; tests call it.
"""

from __future__ import annotations

import contextlib
import sys

import torch

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_STATE = "_smc_sd_capture"


def check_supported() -> None:
    """Raise RuntimeError if the installed vLLM is not one this module was written against."""
    import vllm
    from vllm.v1.worker import gpu_input_batch, gpu_model_runner

    if vllm.__version__ not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"smc_sd.backends.vllm_capture supports vLLM {SUPPORTED_VLLM_VERSIONS}, "
            f"found {vllm.__version__}; re-check the model-runner internals it uses"
        )
    runner = gpu_model_runner.GPUModelRunner
    batch = gpu_input_batch.InputBatch
    for owner, name in [(runner, "_model_forward"), (batch, "num_reqs")]:
        if not hasattr(owner, name):
            raise RuntimeError(f"vLLM internals changed: {owner.__name__}.{name} is gone")


@contextlib.contextmanager
def scannable_modules():
    """Hide, while a vLLM engine is built, the module attributes its kernel-override scan breaks on.

    vLLM 0.32.0's worker start (`register_triton_kernel_overrides`, vllm/triton_utils/dispatcher.py)
    walks every attribute of every loaded module and reads `vars(value).get("kernel")` of each
    value that has a `__dict__`. A lazy proxy whose `__getattr__` answers every name returns a
    non-mapping there: llvmlite's `binding.ffi.lib`, loaded with numba by genlm-control, which
    every constraint imports. The scan then raises AttributeError and the engine never starts.
    Such attributes are removed for the duration and put back afterwards; nothing in the engine
    start calls them.
    """
    hidden = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            try:
                readable = not hasattr(value, "__dict__") or hasattr(vars(value), "get")
            except TypeError:
                readable = False
            if not readable:
                hidden.append((namespace, name, value))
                del namespace[name]
    try:
        yield
    finally:
        for namespace, name, value in hidden:
            namespace[name] = value


def install(worker) -> str:
    """Wrap the worker's model runner so it captures the logit rows asked for. Idempotent.

    Returns:
        The runner's class name.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = worker.model_runner
    if not isinstance(runner, GPUModelRunner):
        raise RuntimeError(
            f"smc-sd's vLLM backend needs the V1 model runner, got {type(runner).__name__} "
            "(set VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    if getattr(runner, _STATE, None) is None:
        state = {"last": 0, "rows": {}, "sample": None, "compute_logits": runner.model.compute_logits}
        setattr(runner, _STATE, state)
        forward = runner._model_forward

        def capturing_forward(*args, **kwargs):
            output = forward(*args, **kwargs)
            state["sample"] = None
            if state["last"] > 0:
                _capture(runner, kwargs.get("positions", args[1] if len(args) > 1 else None), output, state)
            return output

        def reusing_compute_logits(hidden_states):
            # vLLM next asks for the logits of each request's last scheduled token, which the
            # capture has usually just computed: hand those back instead of a second LM-head pass
            sample, state["sample"] = state["sample"], None
            if sample is not None and sample[0].shape == hidden_states.shape and torch.equal(sample[0], hidden_states):
                return sample[1]
            return state["compute_logits"](hidden_states)

        runner._model_forward = capturing_forward
        runner.model.compute_logits = reusing_compute_logits
    return type(runner).__name__


def want_last(worker, last: int) -> None:
    """Capture the logits after each of the last `last` tokens of every request (0 = nothing)."""
    getattr(worker.model_runner, _STATE)["last"] = last


def take(worker) -> dict:
    """The captured rows since the last take: {token tuple: {position: [V] float32}}."""
    state = getattr(worker.model_runner, _STATE)
    rows, state["rows"] = state["rows"], {}
    return rows


def _capture(runner, positions: torch.Tensor, hidden_states, state: dict) -> None:
    """Record logits for the wanted positions of one forward.

    Args:
        positions: [T] int64 position of every scheduled token (requests back to back, in the
            input batch's order; T may include padding at the end).
        hidden_states: [T, H] the decoder's last hidden states.
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise RuntimeError("vLLM internals changed: _model_forward no longer returns a tensor")
    batch = runner.input_batch
    count = batch.num_reqs
    # [R + 1] offsets of each request's scheduled tokens in the flattened batch
    starts = runner.query_start_loc.cpu[: count + 1].tolist()
    positions = positions.cpu().tolist()
    picked, owners = [], []
    for i in range(count):
        length = int(batch.num_prompt_tokens[i])
        first_wanted = length - state["last"]
        for row in range(starts[i], starts[i + 1]):
            position = positions[row]
            if first_wanted <= position < length:
                picked.append(row)
                owners.append((i, length, position))
    if not picked:
        return
    rows = torch.tensor(picked, device=hidden_states.device)
    with torch.inference_mode():
        # [P, V] raw logits (the LM head; tensor-parallel workers gather inside compute_logits,
        # and ranks that do not receive the gathered logits get None)
        logits = state["compute_logits"](hidden_states[rows])
    # each request's last scheduled token: vLLM samples from its logits right after this forward
    last_rows = [end - 1 for end in starts[1:]]
    where = {row: index for index, row in enumerate(picked)}
    if all(row in where for row in last_rows):
        index = torch.tensor([where[row] for row in last_rows], device=hidden_states.device)
        state["sample"] = (hidden_states[rows[index]], None if logits is None else logits[index])
    if logits is None:
        return
    logits = logits.to(device="cpu", dtype=torch.float32)
    keys: dict[int, tuple] = {}
    for (i, length, position), row in zip(owners, logits):
        if i not in keys:
            keys[i] = tuple(batch.token_ids_cpu[i, :length].tolist())
        state["rows"].setdefault(keys[i], {})[position] = row.clone()
