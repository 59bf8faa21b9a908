"""Strait's CPU kernels (libs/engine/kernels) against torch's float64 results, and the model
runner's use of them. The kernels must build here: no skip (CI has a compiler)."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench.support.tiny_models import tiny_model
from libs.engine import kernels
from libs.engine.kernels.linear import PackedLinear, pack_linears

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def k() -> object:
    return kernels.build()


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 32, 100])
@pytest.mark.parametrize(
    ("n", "kdim", "bias"), [(64, 48, False), (50, 37, True), (192, 576, False), (117, 40, True)]
)
def test_packed_linear_matches_linear(k, m: int, n: int, kdim: int, bias: bool) -> None:
    torch.manual_seed(m * 1000 + n)
    w, x = torch.randn(n, kdim), torch.randn(m, kdim)
    b = torch.randn(n) if bias else None
    y = k.packed_linear(x, k.pack_weight(w), n, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * kdim**0.5)


@pytest.mark.parametrize(("n", "kdim", "bias"), [(100, 576, False), (117, 40, True)])
def test_packed_linear_rows_do_not_depend_on_the_batch(k, n: int, kdim: int, bias: bool) -> None:
    """Every output is one FMA chain over k: a row's result is bit-identical alone (the
    four-panel single-row path) or in any batch, at any position (rows fall in different
    micro-tiles)."""
    torch.manual_seed(0)
    w, x = torch.randn(n, kdim), torch.randn(23, kdim)
    b = torch.randn(n) if bias else None
    packed = k.pack_weight(w)
    batch = k.packed_linear(x, packed, n, b)
    for i in (0, 5, 6, 22):
        assert torch.equal(k.packed_linear(x[i : i + 1], packed, n, b)[0], batch[i])
    assert torch.equal(k.packed_linear(x[3:20], packed, n, b), batch[3:20])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX2/AVX-512 are x86-64 builds")
def test_avx512_and_avx2_builds_give_the_same_bits(k) -> None:
    """The AVX-512 tiles (two panels, twelve rows) run the same FMA chains as the AVX2 ones:
    an engine's answers do not depend on which CPU it landed on. On a CPU without AVX-512 both
    builds take the AVX2 path and agree trivially."""
    avx2 = kernels.build("avx2")
    assert not avx2.avx512
    torch.manual_seed(1)
    for m in (2, 5, 12, 13, 24, 32, 33):
        for n, kdim in ((576, 576), (49, 37), (48, 100), (200, 64)):
            x, w, b = torch.randn(m, kdim), torch.randn(n, kdim), torch.randn(n)
            y = k.packed_linear(x, k.pack_weight(w), n, b)
            assert torch.equal(y, avx2.packed_linear(x, avx2.pack_weight(w), n, b)), (m, n, kdim)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AVX2/AVX-512 are x86-64 builds")
@pytest.mark.parametrize(("bits", "offsets"), [(4, True), (4, False), (8, False)])
def test_block_kernel_builds_give_the_same_bits(k, bits: int, offsets: bool) -> None:
    """The block kernel's AVX2 tiles (two 8-float halves a panel, vpmaddubsw for the integer
    dot) compute what the AVX-512 ones (VNNI) compute, bit for bit, on both paths. On a CPU
    without AVX-512 both builds take the AVX2 path and agree trivially."""
    from libs.engine.quant import Blocks
    from libs.engine.quant.blocks import fp16_exact, pack

    avx2 = kernels.build("avx2")
    assert avx2.avx2 and avx2.int8_dot
    torch.manual_seed(2)
    n, kdim, group = 200, 128, 64 if bits == 4 else 128
    q = torch.randint(0, 16, (n, kdim)) if bits == 4 else torch.randint(-128, 128, (n, kdim))
    d = fp16_exact(torch.rand(n, kdim // group) * 0.05 + 1e-3)
    m = fp16_exact(torch.randn(n, kdim // group) * 0.1) if offsets else None
    qweight, scales, mins = pack(Blocks(q, d, m, bits, group))
    bias = torch.randn(n)
    for act_bits in (32, 8) if k.int8_dot else (32,):
        for rows in (1, 3, 8, 13):
            x = torch.randn(rows, kdim)
            args = (x, qweight, scales, mins, n, bits, group, act_bits, bias)
            assert torch.equal(k.block_linear(*args), avx2.block_linear(*args)), (act_bits, rows)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 31, 32, 33, 40, 49152, 49155])
def test_argmax_rows_matches_torch_argmax(k, n: int) -> None:
    """Greedy decoding takes this arg-max: it must pick torch's index in every case, ties
    (first wins), NaN (the first NaN wins), -inf rows, and widths off the vector length."""
    torch.manual_seed(n)
    x = torch.randn(9, n)
    x[1] = x[1].round()  # many ties
    x[2] = float("-inf")
    x[3, n // 2] = float("nan")
    x[4, -1] = float("nan")
    x[4, n // 3] = float("nan")
    x[5, :] = 0.0
    x[5, -1] = -0.0
    x[6, -1] = x[6].max() + 1  # the maximum in the scalar tail
    x[7, 0] = float("inf")
    x[7, -1] = float("inf")
    for build in (k, kernels.build("avx2")):
        got = build.argmax_rows(x)
        assert got.dtype == torch.long
        assert torch.equal(got, x.argmax(dim=-1)), (n, got, x.argmax(dim=-1))
    # a non-contiguous view (a gather of rows comes in contiguous, but nothing relies on it)
    assert torch.equal(k.argmax_rows(x.t().contiguous().t()), x.argmax(dim=-1))


def test_argmax_rows_rejects_other_dtypes_and_shapes(k) -> None:
    with pytest.raises(RuntimeError, match="float32"):
        k.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float32"):
        k.argmax_rows(torch.zeros(3))


def test_packed_linear_rejects_mismatched_shapes(k) -> None:
    packed = k.pack_weight(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="K mismatch"):
        k.packed_linear(torch.randn(2, 17), packed, 32, None)
    with pytest.raises(RuntimeError, match="N mismatch"):
        k.packed_linear(torch.randn(2, 16), packed, 64, None)


def reference_decode(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    """float64 attention of each sequence's one query over its first lens[b] cached tokens."""
    b, h, d = q.shape
    hkv, _, bs, _ = k_cache.shape
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        blocks = tables[i, : -(-n // bs)]
        keys = k_cache[:, blocks].reshape(hkv, -1, d)[:, :n].double()
        vals = v_cache[:, blocks].reshape(hkv, -1, d)[:, :n].double()
        qi = q[i].double().view(hkv, h // hkv, d)
        p = torch.softmax(qi @ keys.transpose(1, 2) * scale, dim=-1)
        out[i] = (p @ vals).reshape(h, d)
    return out


@pytest.mark.parametrize(
    ("h", "hkv", "d", "bs"), [(9, 3, 64, 16), (4, 2, 16, 4), (8, 8, 128, 8), (6, 2, 12, 4)]
)
def test_paged_row_attention_matches_reference(k, h: int, hkv: int, d: int, bs: int) -> None:
    torch.manual_seed(d + bs)
    num_blocks, lens = 64, torch.tensor([1, bs, bs + 1, 3 * bs - 1, 7 * bs + 5])
    max_blocks = int(-(-lens.max() // bs))
    k_cache = torch.randn(hkv, num_blocks, bs, d)
    v_cache = torch.randn(hkv, num_blocks, bs, d)
    # Scattered, distinct blocks; rows padded past each sequence's blocks with its last block.
    perm = torch.randperm(num_blocks)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), h, d) * 3  # peaked softmax: exercises the max subtraction
    out = k.paged_row_attention(q, k_cache, v_cache, perm, lens, d**-0.5)
    ref = reference_decode(q, k_cache, v_cache, perm, lens, d**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_paged_row_attention_reads_a_layer_view_of_the_cache(k) -> None:
    """The runner passes views of one [layers, 2, Hkv, blocks, bs, D] tensor."""
    torch.manual_seed(1)
    data = torch.randn(2, 2, 2, 10, 4, 16)
    tables, lens = torch.tensor([[3, 7, 1]]), torch.tensor([10])
    q = torch.randn(1, 4, 16)
    out = k.paged_row_attention(q, data[1, 0], data[1, 1], tables, lens, 0.25)
    ref = reference_decode(q, data[1, 0], data[1, 1], tables, lens, 0.25)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def paged_decode_case() -> tuple:
    """Two sequences decoding one token each into a 3-layer cache, written at layer 1."""
    torch.manual_seed(2)
    kv = torch.randn(3, 2, 2, 12, 4, 16)  # [layers, 2, Hkv, blocks, block_size, D]
    q, key, value = torch.randn(2, 6, 16), torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    tables = torch.tensor([[5, 2, 9], [11, 0, 0]])  # second row padded
    lens = torch.tensor([11, 3])  # the new tokens sit at positions 10 and 2
    slots = torch.tensor([9 * 4 + 2, 11 * 4 + 2])
    return q, key, value, kv, 1, slots, tables, lens, 0.25


@pytest.mark.parametrize("via", ["dispatcher", "pybind"])
def test_paged_attention_writes_the_new_tokens_then_attends(k, via: str) -> None:
    q, key, value, kv, layer, slots, tables, lens, scale = paged_decode_case()
    before = kv.clone()
    op = torch.ops.strait.paged_attention if via == "dispatcher" else k.paged_attention
    out = op(q, key, value, kv, layer, slots, tables, lens, scale)
    expected = before.clone()
    flat = expected[layer].view(2, 2, 12 * 4, 16)  # [k/v, Hkv, slots, D]
    flat[0, :, slots] = key.transpose(0, 1)
    flat[1, :, slots] = value.transpose(0, 1)
    assert torch.equal(kv, expected)  # the two slots of layer 1, nothing else
    ref = reference_decode(q, kv[layer, 0], kv[layer, 1], tables, lens, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def chunk_and_decode_case() -> tuple:
    """One step of a prefill chunk and a decode token: sequence A has 5 tokens cached (blocks
    7, 3) and adds positions 5..8 (into blocks 3 and 10); sequence B decodes position 2."""
    torch.manual_seed(3)
    kv = torch.randn(2, 2, 2, 12, 4, 16)  # [layers, 2, Hkv, blocks, block_size, D]
    q, key, value = torch.randn(5, 6, 16) * 3, torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    tables = torch.tensor([[7, 3, 10]] * 4 + [[1, 1, 1]])  # one row per token, B's padded
    lens = torch.tensor([6, 7, 8, 9, 3])  # position + 1: each row sees keys 0..position
    slots = torch.tensor([3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 10 * 4 + 0, 1 * 4 + 2])
    return q, key, value, kv, 0, slots, tables, lens, 0.25


def test_paged_attention_runs_a_prefill_chunk_causally_beside_a_decode_token(k) -> None:
    q, key, value, kv, layer, slots, tables, lens, scale = chunk_and_decode_case()
    out = torch.ops.strait.paged_attention(q, key, value, kv, layer, slots, tables, lens, scale)
    # Chunk token i sees the cached tokens and chunk tokens 0..i, not the ones after it.
    keys = kv[layer, 0][:, [7, 3, 10]].reshape(2, 12, 16)[:, :9].double()
    vals = kv[layer, 1][:, [7, 3, 10]].reshape(2, 12, 16)[:, :9].double()
    # [T, Hkv, G, D] -> [Hkv, G * T, D]: row g * 4 + i is chunk token i of group member g
    qa = q[:4].double().view(4, 2, 3, 16).permute(1, 2, 0, 3).reshape(2, 12, 16)
    causal = torch.arange(9) <= torch.arange(5, 9).repeat(3).unsqueeze(1)  # [G * 4, 9]
    ref = F.scaled_dot_product_attention(qa, keys, vals, attn_mask=causal, scale=scale)
    ref = ref.view(2, 3, 4, 16).permute(2, 0, 1, 3).reshape(4, 6, 16)
    torch.testing.assert_close(out[:4].double(), ref, rtol=1e-5, atol=1e-5)
    ref_b = reference_decode(q[4:], kv[layer, 0], kv[layer, 1], tables[4:], lens[4:], scale)
    torch.testing.assert_close(out[4:].double(), ref_b, rtol=1e-5, atol=1e-5)


def test_paged_row_attention_rows_do_not_depend_on_the_step(k) -> None:
    """A row's result is bit-identical alone or beside any other rows (batch invariance)."""
    q, key, value, kv, layer, slots, tables, lens, scale = chunk_and_decode_case()
    torch.ops.strait.paged_attention(q, key, value, kv, layer, slots, tables, lens, scale)
    kc, vc = kv[layer, 0], kv[layer, 1]
    full = k.paged_row_attention(q, kc, vc, tables, lens, scale)
    for i in range(5):
        alone = k.paged_row_attention(
            q[i : i + 1], kc, vc, tables[i : i + 1], lens[i : i + 1], scale
        )
        assert torch.equal(alone, full[i : i + 1])


def test_paged_attention_rejects_a_slot_outside_the_cache(k) -> None:
    q, key, value, kv, layer, _slots, tables, lens, scale = paged_decode_case()
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        torch.ops.strait.paged_attention(
            q, key, value, kv, layer, torch.tensor([0, 12 * 4]), tables, lens, scale
        )


def test_dispatcher_ops_have_consistent_schemas_and_shape_functions(k) -> None:
    """What torch.compile relies on: schema, fake kernels and mutation annotations agree with
    the real kernels (torch.library.opcheck)."""
    x, w = torch.randn(5, 24), torch.randn(40, 24)
    torch.library.opcheck(torch.ops.strait.packed_linear.default, (x, k.pack_weight(w), 40, None))
    torch.library.opcheck(torch.ops.strait.paged_attention.default, paged_decode_case())
    torch.library.opcheck(torch.ops.strait.paged_attention.default, chunk_and_decode_case())


def test_pack_linears_keeps_a_tied_head_and_the_outputs() -> None:
    model = tiny_model("llama", seed=3)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tie, as SmolLM2 is
    ids = torch.tensor([[5, 17, 250, 3, 99]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    k = kernels.build()
    packed = pack_linears(model, k)
    assert packed == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the embedding still reads it
    assert model.model.layers[0].self_attn.q_proj.weight is None  # untied originals are freed
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    # One arena on huge pages holds every packed weight (libs/engine/host_memory.py).
    assert len({m.packed.untyped_storage().data_ptr() for m in layers}) == 1
    with torch.inference_mode():
        after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_load_follows_the_setting() -> None:
    assert kernels.load("off", "cpu", "float32") is None
    assert kernels.load("auto", "cpu", "bfloat16") is None
    assert kernels.load("auto", "cuda", "float32") is None
    assert kernels.load("auto", "cpu", "float32") is not None
    with pytest.raises(ValueError, match="float32 CPU"):
        kernels.load("on", "cuda:0", "float32")


def test_auto_falls_back_to_torch_when_the_build_fails(monkeypatch, caplog) -> None:
    def no_compiler() -> None:
        raise OSError("c++: not found")

    monkeypatch.setattr(kernels, "build", no_compiler)
    with caplog.at_level("WARNING", logger="strait.engine"):
        assert kernels.load("auto", "cpu", "float32") is None
    assert "using torch's" in caplog.text
    with pytest.raises(OSError, match="not found"):
        kernels.load("on", "cpu", "float32")


@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 2, 64), (6, 3, 128), (8, 2, 64)])
def test_query_heads_sharing_a_kv_head_get_the_bits_of_attending_alone(
    k, h: int, hkv: int, d: int
) -> None:
    """The query heads of one KV head are attended together (keys and values loaded once for
    them): each head's result is bit-identical to a cache with a KV head of its own."""
    torch.manual_seed(h * d)
    bs, num_blocks = 16, 48
    lens = torch.tensor([1, 7, bs, 3 * bs + 5, 20 * bs - 3])
    max_blocks = int(-(-lens.max() // bs))
    k_cache, v_cache = torch.randn(hkv, num_blocks, bs, d), torch.randn(hkv, num_blocks, bs, d)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), h, d) * 3
    shared = k.paged_row_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
    g = h // hkv  # one KV head per query head: every head attended on its own
    own_k = k_cache.repeat_interleave(g, dim=0).contiguous()
    own_v = v_cache.repeat_interleave(g, dim=0).contiguous()
    alone = k.paged_row_attention(q, own_k, own_v, tables, lens, d**-0.5)
    assert torch.equal(shared, alone)


@pytest.mark.parametrize(("h", "hkv"), [(9, 3), (4, 2)])
def test_rows_sharing_a_block_table_get_the_bits_of_attending_alone(k, h: int, hkv: int) -> None:
    """A sequence's decode row and its speculative rows (one block table, positions in a row),
    beside another sequence, are attended as one run: each row's bits are those it gets alone,
    and those of a cache with a KV head per query head."""
    torch.manual_seed(h)
    d, bs, num_blocks = 64, 16, 64
    first = torch.randperm(num_blocks)[:40]
    other = torch.randperm(num_blocks)[:40]
    tables = torch.stack([first] * 9 + [other] + [first] * 20)  # 9 + 1 + 20 (two runs of 16, 4)
    lens = torch.cat([torch.arange(300, 309), torch.tensor([77]), torch.arange(500, 520)])
    k_cache, v_cache = torch.randn(hkv, num_blocks, bs, d), torch.randn(hkv, num_blocks, bs, d)
    q = torch.randn(len(lens), h, d) * 3
    together = k.paged_row_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
    for i in range(len(lens)):
        alone = k.paged_row_attention(
            q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], d**-0.5
        )
        assert torch.equal(alone, together[i : i + 1])
    g = h // hkv
    own = [c.repeat_interleave(g, dim=0).contiguous() for c in (k_cache, v_cache)]
    assert torch.equal(k.paged_row_attention(q, *own, tables, lens, d**-0.5), together)


def test_every_kernel_file_is_compiled_or_hashed_and_every_include_is_hashed() -> None:
    """The loader compiles SOURCES and names the build by the hash of SOURCES and HEADERS: a
    .cpp left out would not be linked, a header left out would let an edit reuse a stale
    build."""
    here = kernels.HERE
    assert {p.name for p in here.glob("*.cpp")} == {p.name for p in kernels.SOURCES}
    assert {p.name for p in here.glob("*.h")} == {p.name for p in kernels.HEADERS}
    included = {
        line.split('"')[1]
        for path in (*kernels.SOURCES, *kernels.HEADERS)
        for line in path.read_text().splitlines()
        if line.startswith('#include "')
    }
    assert included == {p.name for p in kernels.HEADERS}


def test_the_build_name_changes_with_any_source_or_header(monkeypatch, tmp_path) -> None:
    """Two checkouts (or an edited one) share torch's extensions cache: each set of sources
    gets a build directory of its own, whichever file differs."""
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(kernels, "SOURCES", tuple(tmp_path / p.name for p in kernels.SOURCES))
    monkeypatch.setattr(kernels, "HEADERS", tuple(tmp_path / p.name for p in kernels.HEADERS))
    original = kernels.source_tag()
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        text = path.read_bytes()
        path.write_bytes(text + b"// edited\n")
        assert kernels.source_tag() != original, path.name
        path.write_bytes(text)
    assert kernels.source_tag() == original


def test_the_wheel_ships_every_kernel_file() -> None:
    """Workers compile the kernels from the installed package: pyproject's package-data must
    match every source and header."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).parents[3] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["*"]
    for path in (*kernels.SOURCES, *kernels.HEADERS):
        assert any(fnmatch.fnmatch(path.name, pat) for pat in patterns), path.name
