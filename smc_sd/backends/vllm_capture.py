"""The one place smc-sd reaches into vLLM's internals: full raw logit rows read in the worker, and
requests driven on the engine core directly, some of them resumable sessions.

vLLM's public API gives next-token log-probabilities as top-k dictionaries, and prompt
log-probabilities only for requests that skip the prefix cache (vLLM 0.32.0's
`SamplingParams.__post_init__` sets `skip_reading_prefix_cache` whenever `prompt_logprobs` is
set), so every cycle would recompute the whole context. Instead this module wraps the V1 model
runner's `_model_forward`: after each forward it reads the hidden states of the positions smc-sd
asked for and applies the model's own `compute_logits` (the LM head, raw logits, no temperature).

Contract with the worker (installed and read through `LLM.collective_rpc`, so it also runs in
every tensor-parallel worker process, where `compute_logits` is a collective):
- `install(worker)` wraps the runner once;
- `want(worker, {request id: L})`: from now on, for every scheduled request named there, whose
  prompt is x_1..x_n (the request's whole token list: smc-sd's requests generate one token),
  capture the raw next-token logits after the token at every scheduled 0-based position
  p >= n - L;
- `take(worker)` returns and clears ({request id: {p: logits [V] float32}}, {request id: tokens
  the worker computed for it}), and captures nothing more until the next `want`.
Positions that vLLM served from its prefix cache are not scheduled and therefore not captured;
the caller asks again for them with shorter requests (see `VLLMLanguageModel.forward`).
The wrapper also replaces the model's `compute_logits` by one that returns the rows it has just
computed when vLLM asks for the same hidden states (each request's last token, to sample from),
so the LM head runs once per position, not twice.

Requests (`submit`, `drive`, `abort`) bypass `LLM.generate` and its output processor: smc-sd reads
logits, not outputs. A resumable request is vLLM's streaming-input session: after its one token
it waits, holding every KV block of its tokens (the last, partial block too), and a later
`submit` under its id appends tokens that vLLM computes alone (the token it sampled is dropped).
An ordinary request frees its blocks at once; the prefix cache keeps only full ones. `roll_back`
shortens a waiting session in the scheduler and its KV cache manager (vLLM's streaming input
only appends), so a row rolled back by smc-sd's verification keeps its session.

Supported: vLLM 0.32.0 with the V1 model runner (`GPUModelRunner` and its `CPUModelRunner`
subclass) and the engine core in this process. `check_supported` names what changed when
internals move; tests call it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Callable

import torch

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
_STATE = "_smc_sd_capture"


def check_supported() -> None:
    """Raise RuntimeError if the installed vLLM is not one this module was written against."""
    import vllm
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker import gpu_input_batch, gpu_model_runner

    if vllm.__version__ not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"smc_sd.backends.vllm_capture supports vLLM {SUPPORTED_VLLM_VERSIONS}, "
            f"found {vllm.__version__}; re-check the model-runner internals it uses"
        )
    runner = gpu_model_runner.GPUModelRunner
    batch = gpu_input_batch.InputBatch
    for owner, name in [(runner, "_model_forward"), (batch, "num_reqs"), (batch, "req_ids"), (Scheduler, "_update_request_as_session"),
                        (EngineCore, "step"), (EngineCore, "post_step"), (EngineCore, "preprocess_add_request"), (EngineCore, "abort_requests"),
                        (BlockPool, "_maybe_evict_cached_block"), (BlockPool, "free_blocks"), (FullAttentionManager, "cache_blocks")]:
        if not hasattr(owner, name):
            raise RuntimeError(f"vLLM internals changed: {owner.__name__}.{name} is gone")
    if "resumable" not in inspect.signature(InputProcessor.process_inputs).parameters:
        raise RuntimeError("vLLM internals changed: InputProcessor.process_inputs takes no `resumable`")


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
        state = {"want": {}, "rows": {}, "computed": {}, "sample": None, "compute_logits": runner.model.compute_logits}
        setattr(runner, _STATE, state)
        forward = runner._model_forward

        def capturing_forward(*args, **kwargs):
            output = forward(*args, **kwargs)
            state["sample"] = None
            if state["want"]:
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


def want(worker, counts: dict[str, int]) -> None:
    """Capture, for each request named, the logits after each of its last counts[id] tokens
    (replaces the previous wish; {} captures nothing)."""
    getattr(worker.model_runner, _STATE)["want"] = counts


def take(worker) -> tuple[dict, dict]:
    """The captured rows since the last take, {request id: {position: [V] float32}}, and the
    tokens computed per wanted request, {request id: count}; the wish is forgotten."""
    state = getattr(worker.model_runner, _STATE)
    state["want"] = {}
    rows, state["rows"] = state["rows"], {}
    computed, state["computed"] = state["computed"], {}
    return rows, computed


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
    wanted, computed = state["want"], state["computed"]
    picked, owners = [], []
    for i, request in enumerate(batch.req_ids[:count]):
        last = wanted.get(request, 0)
        if not last:
            continue
        computed[request] = computed.get(request, 0) + starts[i + 1] - starts[i]
        length = int(batch.num_prompt_tokens[i])
        for row in range(starts[i], starts[i + 1]):
            if length - last <= positions[row] < length:
                picked.append(row)
                owners.append((request, positions[row]))
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
    for (request, position), row in zip(owners, logits):
        state["rows"].setdefault(request, {})[position] = row.clone()


def submit(llm, request_id: str, tokens: list[int], params, resumable: bool) -> None:
    """Queue one request on the engine core: a new request over `tokens`, or, under the id of a
    waiting session, that session's next tokens.

    Args:
        resumable: open (or continue) a session, which keeps its KV after its token.
    """
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    request = engine.input_processor.process_inputs(
        request_id, TokensPrompt(prompt_token_ids=list(tokens)), params, supported_tasks=engine.get_supported_tasks(), resumable=resumable
    )
    request.external_req_id = request_id
    core = _core(llm)
    core.add_request(*core.preprocess_add_request(request))


def abort(llm, request_ids: list[str]) -> None:
    """End requests (sessions): their KV blocks return to the pool (full ones stay cached)."""
    if request_ids:
        _core(llm).abort_requests(list(request_ids))


def roll_back(llm, session: str, length: int) -> bool:
    """Shorten a waiting session to its first `length` >= 1 tokens, keeping the KV of those.

    Blocks wholly past `length` return to the pool (full ones stay in the prefix cache, their
    content unchanged); the block holding position length - 1 is written over from `length` on
    by the session's next tokens, so it must be the session's alone, and it leaves the prefix
    cache (its content will no longer match its hash).

    Returns:
        False, changing nothing, when that block is shared with another request or the session
        is not a waiting one over full-attention layers; the caller then ends the session.
    """
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.request import RequestStatus

    scheduler = _core(llm).scheduler
    request = scheduler.requests.get(session)
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    if (request is None or request.status != RequestStatus.WAITING_FOR_STREAMING_REQ or len(managers) != 1
            or type(managers[0]) is not FullAttentionManager or not 1 <= length <= request.num_computed_tokens):
        return False
    manager, pool = managers[0], scheduler.kv_cache_manager.block_pool
    blocks = manager.req_to_blocks[session]
    # blocks holding positions 0 .. length - 1
    kept = -(-length // manager.block_size)
    if length % manager.block_size:
        if blocks[kept - 1].ref_cnt != 1:
            return False
        pool._maybe_evict_cached_block(blocks[kept - 1])
    pool.free_blocks(reversed(blocks[kept:]))
    del blocks[kept:]
    manager.num_cached_block[session] = min(manager.num_cached_block.get(session, 0), length // manager.block_size)
    request.num_computed_tokens = request.num_prompt_tokens = length
    del request._all_token_ids[length:]
    del request.prompt_token_ids[length:]
    request._output_token_ids.clear()
    del request.block_hashes[length // scheduler.hash_block_size :]
    return True


def drive(llm, pending: set[str], evict: Callable[[set[str]], bool]) -> None:
    """Step the engine until every request in `pending` has produced its token.

    Waiting sessions hold model-runner slots and KV blocks; when a step schedules nothing while
    requests wait, `evict(still_pending)` ends one session that is not among them (False: none
    is left).

    Raises:
        RuntimeError: when nothing can be scheduled and no session is left to end.
    """
    core = _core(llm)
    pending = set(pending)
    while pending:
        outputs, executed = core.step_fn()
        core.post_step(model_executed=executed)
        for batch in outputs.values():
            for output in batch.outputs:
                if output.finish_reason is not None:
                    pending.discard(output.request_id)
        if pending and not executed and not evict(pending):
            raise RuntimeError(f"vLLM scheduled none of {len(pending)} waiting requests, and no session is left to end")


def _core(llm):
    """The engine core running in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("smc-sd's vLLM backend needs the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return core
