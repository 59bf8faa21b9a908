"""What each weight format of a prepared model reads per decode step: ``strait models formats``.

Counts the bytes of every linear weight (scales and offsets included) one forward reads in
each ``engine.quantization`` (the LM head once; embeddings are read a row per token and not
counted), from the shapes in the model directory's safetensors and, for ``gguf``, the block
types in its source GGUF. No model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class FormatRow:
    quantization: str
    linear_bytes: int  # weights (and scales) of every linear, LM head included
    detail: str


def _linear_shapes(model_dir: Path) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """([out, in] of every layer linear, [vocab, hidden] of the LM head)."""
    from safetensors import safe_open

    from libs.engine.quant.gguf import gguf_tensor_name

    shapes: list[tuple[int, int]] = []
    head: tuple[int, int] | None = None
    embed: tuple[int, int] | None = None
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                layer = name.removesuffix(".weight")
                if not layer.endswith("lm_head") and gguf_tensor_name(layer) is not None:
                    shapes.append((int(shape[0]), int(shape[1])))
                elif name.endswith("lm_head.weight"):
                    head = (int(shape[0]), int(shape[1]))
                elif name.endswith("embed_tokens.weight"):
                    embed = (int(shape[0]), int(shape[1]))
    head = head or embed  # tied embeddings
    if head is None:
        raise ValueError(f"no LM head or embedding in {model_dir}")
    return shapes, head


def _gguf_bytes(model_dir: Path) -> tuple[int, str] | None:
    """(bytes of the GGUF's linear tensors, block types) for a directory converted from one."""
    from libs.engine.converted import source_gguf
    from libs.engine.quant.gguf import LAYER_NAMES

    path = source_gguf(model_dir)
    if path is None:
        return None
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    wanted = {
        n
        for n in tensors
        if n.startswith("blk.") and any(n.endswith(f".{k}.weight") for k in LAYER_NAMES.values())
    }
    wanted.add("output.weight" if "output.weight" in tensors else "token_embd.weight")
    total, kinds = 0, set()
    for n in wanted:
        t = tensors[n]
        total += int(t.n_bytes)
        kinds.add(t.tensor_type.name)
    return total, "+".join(sorted(kinds))


def format_rows(model_dir: str | Path, group: int = 32) -> list[FormatRow]:
    """One row per ``engine.quantization`` (and bf16 weights), in bytes read per step."""
    model_dir = Path(model_dir)
    shapes, head = _linear_shapes(model_dir)
    body = sum(o * i for o, i in shapes)
    head_n = head[0] * head[1]
    rows_body = sum(o for o, _ in shapes)
    int8_bytes = body + head_n + 2 * (rows_body + head[0])  # levels + one fp16 scale a row
    int4_bytes = body // 2 + body // group * 4 + head_n + 2 * head[0]  # + fp16 scale, offset
    rows = [
        FormatRow("none", 4 * (body + head_n), "float32"),
        FormatRow("none (dtype=bfloat16)", 2 * (body + head_n), "bfloat16"),
        FormatRow("int8", int8_bytes, "8-bit, a scale per row"),
        FormatRow("int4", int4_bytes, f"4-bit groups of {group}, LM head int8"),
    ]
    gguf = _gguf_bytes(model_dir)
    if gguf is not None:
        rows.append(FormatRow("gguf", gguf[0], f"the source GGUF's blocks ({gguf[1]})"))
    return rows


def cli_formats(model_dir: str | Path) -> list[str]:
    """``strait models formats [NAME]``: one line per format."""
    rows = format_rows(model_dir)
    fp32 = rows[0].linear_bytes
    lines = [f"{'quantization':24} {'MB / step':>10} {'vs fp32':>8}  weights"]
    for r in rows:
        lines.append(
            f"{r.quantization:24} {r.linear_bytes / 1e6:>10.1f} {r.linear_bytes / fp32:>7.2f}x  "
            f"{r.detail}"
        )
    return lines
