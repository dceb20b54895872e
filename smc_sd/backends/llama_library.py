"""llama-cpp-python, imported once: its backend initialised and its log kept to the errors our
one-line messages quote. Every module of the llama.cpp backend reaches the library here."""

from __future__ import annotations

import ctypes

#: the portable build of the llama extra (no -march=native: the building and the running
#: processor may differ); README, "llama.cpp backend"
INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install -e ".[llama]"'

#: llama.cpp's ggml log level of errors (GGML_LOG_LEVEL_ERROR)
_LOG_ERROR = 4

_llama = None
_log_callback = None
_last_errors: list[str] = []


def llama_cpp():
    """The `llama_cpp` module, imported (and its backend initialised, its log silenced) once.

    Raises:
        ValueError: when llama-cpp-python is not installed, saying how to install it.
    """
    global _llama, _log_callback
    if _llama is None:
        try:
            import llama_cpp as module
        except ImportError as error:
            raise ValueError(f"--backend llama-cpp needs llama-cpp-python, which is not installed; install the extra (it builds llama.cpp, 10-16 min on 2 cores): {INSTALL}") from error

        def log(level, text, _data):
            # llama.cpp logs every load at length; keep its errors for our one-line messages
            if level == _LOG_ERROR and text:
                _last_errors.append(text.decode(errors="replace").strip())
                del _last_errors[:-4]

        _log_callback = module.llama_log_callback(log)
        module.llama_log_set(_log_callback, ctypes.c_void_p(0))
        module.llama_backend_init()
        _llama = module
    return _llama


def _llama_error() -> str:
    """llama.cpp's last logged error, or an empty string."""
    return f" ({_last_errors[-1]})" if _last_errors else ""
