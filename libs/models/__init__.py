"""Model preparation: resolve a model name to a local directory, converting GGUF files once.

Public API (used by the engine, the CLI and tests): :func:`prepare_model`, :func:`list_models`,
:func:`convert_gguf`, and the ``cli_*`` helpers that ``strait models ...`` calls.
"""

from libs.models.convert import convert_gguf, is_converted
from libs.models.known import KNOWN_MODELS, KnownModel
from libs.models.prepare import (
    ModelNotFoundError,
    cli_convert,
    cli_list,
    cli_prepare,
    list_models,
    prepare_model,
)

__all__ = [
    "KNOWN_MODELS",
    "KnownModel",
    "ModelNotFoundError",
    "cli_convert",
    "cli_list",
    "cli_prepare",
    "convert_gguf",
    "is_converted",
    "list_models",
    "prepare_model",
]
