"""Convert a GGUF file to a plain safetensors model directory, once.

transformers de-quantises a GGUF on every load (~30 s for SmolLM2 on this CPU) and refuses to
``save_pretrained`` a GGUF-loaded model. So :func:`convert_gguf` loads it once, builds a plain
model from the same config without the quantization config, copies the state dict in, and saves
weights + config + tokenizer; loading that directory later takes ~3 s. Called by
:func:`libs.models.prepare.prepare_model` and by ``strait models convert``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from libs.engine.converted import DONE_MARKER, marker_text

log = logging.getLogger("strait.models")


def is_converted(out_dir: Path) -> bool:
    """True when ``out_dir`` holds a complete conversion."""
    return (out_dir / DONE_MARKER).exists() and (out_dir / "config.json").exists()


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    progress: bool = True,
    chat_template: str | None = None,
    stop_tokens: tuple[str, ...] = (),
) -> Path:
    """Convert ``gguf_path`` into ``out_dir`` (fp32 safetensors + config + tokenizer files).

    ``chat_template`` is saved with the tokenizer when the GGUF ships none; ``stop_tokens``
    join EOS in the generation config (the engine ends a sequence on any of them).

    Writes into a temporary sibling directory and renames it at the end, so a crash never leaves
    a half-written model that looks complete. Returns ``out_dir``.
    """
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    steps = ["read GGUF (de-quantise)", "build plain model", "save weights", "save tokenizer"]
    with (
        tqdm(total=len(steps), desc=f"convert {gguf_path.name}", disable=not progress) as bar,
        tempfile.TemporaryDirectory(
            dir=out_dir.parent, prefix=f".{out_dir.name}.", ignore_cleanup_errors=True
        ) as tmp,
    ):

        def dequantised() -> None:
            bar.update()
            bar.set_postfix_str(steps[1])

        bar.set_postfix_str(steps[0])
        plain = _plain_model(gguf_path, dequantised)
        bar.update()

        bar.set_postfix_str(steps[2])
        plain.save_pretrained(tmp)
        bar.update()

        bar.set_postfix_str(steps[3])
        _save_tokenizer(gguf_path, plain, Path(tmp), chat_template, stop_tokens)
        (Path(tmp) / DONE_MARKER).write_text(marker_text(gguf_path))
        bar.update()

        if out_dir.exists():
            shutil.rmtree(out_dir)
        Path(tmp).rename(out_dir)
        out_dir.chmod(0o755)  # mkdtemp creates 0700
        # ignore_cleanup_errors: the temporary directory has been renamed away.
    log.info("converted %s -> %s", gguf_path, out_dir)
    return out_dir


def _plain_model(gguf_path: Path, dequantised: Callable[[], None]) -> Any:
    """A plain float32 model with the GGUF's weights (``convert_gguf``'s first two steps): the
    GGUF loaded (de-quantised) once, ``dequantised()`` told, then a model built from its config
    without the quantization config and the state dict copied in."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = src.state_dict()
    config_dict = src.config.to_dict()
    del src
    dequantised()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    missing = [k for k in missing if k not in plain._tied_weights_keys]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    return plain


def _save_tokenizer(
    gguf_path: Path,
    plain: Any,
    tmp: Path,
    chat_template: str | None,
    stop_tokens: tuple[str, ...],
) -> None:
    """``convert_gguf``'s last step: the GGUF's tokenizer saved into ``tmp`` (with
    ``chat_template`` when it ships none), and ``stop_tokens`` joined to EOS in ``plain``'s
    generation config."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if chat_template is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(tmp)
    if stop_tokens:
        gen = plain.generation_config
        eos = gen.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        for token in stop_tokens:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
                raise ValueError(f"{gguf_path.name}'s vocabulary has no {token!r}")
            ids.append(token_id)
        gen.eos_token_id = sorted(set(ids))
        gen.save_pretrained(tmp)
