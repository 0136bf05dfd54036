"""A checkpoint with the real Clover's identity that we did not write: transformers' own Qwen3.5-MoE, initialised and
saved by transformers, relabelled as the real checkpoint is labelled (model_type clover_moe, CloverMoeModelLM,
num_shared_experts) with the real checkpoint's four block tensors added.

- Its GGUF, block tensors and our keys aside, equals key for key and tensor for tensor what the pinned tree's own
  converter (convert_hf_to_gguf.py, clover_gguf.testing.upstream) writes for the unrelabelled twin with the
  architecture renamed: upstream's clover_moe converter is the Qwen3.5 one plus expert_shared_count and minus those
  four tensors. The same for `export-ar`, whose file is what upstream's clover_moe converter writes.
- It converts, quantizes and decodes in ar, diffusion and draft-self, and its causal logits through the patched
  llama.cpp are transformers' own.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file, save_file

from clover_gguf.convert import block_mode_keys, convert
from clover_gguf.export import export_ar
from clover_gguf.gguf_header import read_header
from clover_gguf.tensor_map import CLOVER_EXTRA_RE
from clover_gguf.testing.upstream import upstream_convert

NAME = "Clover-35B-A3B-Preview"  # the real repository's folder name: upstream's converter names the model from it
CARD = """---
license: apache-2.0
base_model: Qwen/Qwen3.6-35B-A3B
tags:
- block-diffusion
---
# Clover, made by transformers for a test
"""
GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
# what only our file holds: upstream's clover_moe converter adds expert_shared_count to the Qwen3.5 keys; the card's
# repetition penalty is written even where generation_config.json names none (here it does, so both write it)
UPSTREAM_CLOVER_ONLY = {"clover_moe.expert_shared_count"}


@pytest.fixture(scope="module")
def twins(make_checkpoint, tmp_path_factory) -> dict:
    """{"qwen": the transformers-made Qwen3.5-MoE folder, "clover": its relabelled copy, "model": the module}."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    shape = make_checkpoint(seed=5, plain_qwen=True)  # the tiny shape and a tokenizer with Clover's specials
    cfg = Qwen3_5MoeTextConfig.from_pretrained(shape)
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # off transformers' init (ones, zeros) so that every element carries a distinct value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    root = tmp_path_factory.mktemp("upstream")
    qwen, clover = root / "qwen" / NAME, root / "clover" / NAME
    model.save_pretrained(qwen)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(shape / f, qwen / f)
    (qwen / "README.md").write_text(CARD)
    gen = json.loads((qwen / "generation_config.json").read_text())
    gen.update(GENERATION)
    (qwen / "generation_config.json").write_text(json.dumps(gen))
    shutil.copytree(qwen, clover)

    c = json.loads((clover / "config.json").read_text())
    tok = json.loads((clover / "tokenizer.json").read_text())
    mask = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|mask|>")
    c.update(model_type="clover_moe", architectures=["CloverMoeModelLM"], num_shared_experts=1, mask_token_id=mask,
             block_size=32)
    (clover / "config.json").write_text(json.dumps(c, indent=1))
    g = torch.Generator().manual_seed(1)
    conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
        c["linear_num_value_heads"] * c["linear_value_head_dim"]
    hv = c["linear_num_value_heads"]
    extras = {}
    for i, kind in enumerate(c["layer_types"]):
        if kind == "linear_attention":
            p = f"model.layers.{i}.linear_attn."
            extras[p + "conv_right_weight"] = torch.randn(conv_dim, 1, 4, generator=g) * 0.3
            extras[p + "bd_softmax_logit_scale"] = torch.randn(hv, generator=g) * 0.1
            extras[p + "bd_softmax_history_bias"] = torch.randn(hv, generator=g)
            extras[p + "bd_softmax_history_c"] = torch.rand(hv, generator=g)
    save_file(extras, clover / "model-extras.safetensors")
    weight_map = {k: "model.safetensors" for k in load_file(clover / "model.safetensors")}
    weight_map.update({k: "model-extras.safetensors" for k in extras})
    (clover / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"qwen": qwen, "clover": clover, "model": model, "root": root}


def _kv_and_tensors(path: Path) -> tuple[dict, dict]:
    h = read_header(path, full=True)
    kv = {k: (h.types[k], v) for k, v in h.kv.items()}
    tensors = {t.name: (t.tensor_type, tuple(int(x) for x in t.shape), np.asarray(t.data).tobytes())
               for t in GGUFReader(path).tensors}
    return kv, tensors


def _as_clover_moe(kv: dict) -> dict:
    out = {k.replace("qwen35moe.", "clover_moe.", 1): v for k, v in kv.items()}
    out["general.architecture"] = (out["general.architecture"][0], "clover_moe")
    return out


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_causal_file_equals_the_pinned_converter(twins, outtype):
    up_kv, up_t = _kv_and_tensors(upstream_convert(twins["qwen"], twins["root"] / f"upstream-{outtype}.gguf", outtype))
    assert up_kv["general.architecture"][1] == "qwen35moe" and up_kv["general.name"][1]  # its own naming ran
    want = _as_clover_moe(up_kv)
    ours = twins["root"] / f"ours-{outtype}.gguf"
    convert(twins["clover"], ours, outtype=outtype, quiet=True, force=True)
    kv, tensors = _kv_and_tensors(ours)

    ours_only = set(block_mode_keys(*_cfg_and_gen(twins["clover"]))) | UPSTREAM_CLOVER_ONLY
    assert {k: kv[k] for k in kv if k not in ours_only} == want
    assert kv["clover_moe.expert_shared_count"][1] == 1
    block = {n for n in tensors if CLOVER_EXTRA_RE.match(n)}
    assert len(block) == 4 * 3  # the four block tensors of each of the three GDN layers
    causal = {n: t for n, t in tensors.items() if n not in block}
    assert causal.keys() == up_t.keys()
    for n in up_t:
        assert causal[n] == up_t[n], n  # type, shape and every byte

    # export-ar: exactly upstream's clover_moe file, which is the above minus everything ours
    ar = twins["root"] / f"ar-{outtype}.gguf"
    export_ar(ours, ar, quiet=True, force=True)
    kv_ar, t_ar = _kv_and_tensors(ar)
    assert {k: kv_ar[k] for k in kv_ar if k not in UPSTREAM_CLOVER_ONLY} == want
    assert t_ar == up_t


def _cfg_and_gen(src: Path):
    from clover_gguf.config import CloverConfig
    from clover_gguf.convert import read_generation_defaults

    return CloverConfig.from_file(src), read_generation_defaults(src)


def test_relabelled_checkpoint_gives_transformers_logits(twins):
    from clover_gguf.llama_context import LlamaContext
    from clover_gguf.testing.device import env_offload_kwargs

    gguf = convert(twins["clover"], twins["root"] / "logits-f32.gguf", outtype="f32", quiet=True, force=True).out
    ids = np.random.default_rng(7).integers(0, twins["model"].config.vocab_size, size=29).tolist()
    with torch.no_grad():
        want = twins["model"](torch.tensor([ids])).logits[0].numpy().astype(np.float64)
    r = LlamaContext(gguf, n_threads=2, n_ctx=256, n_ubatch=256, exact=True, **env_offload_kwargs())
    try:
        got = np.asarray(r.decode(ids, 0, 0), dtype=np.float64)
    finally:
        r.close()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4


def test_relabelled_checkpoint_quantizes_and_decodes_in_every_mode(twins):
    from clover_gguf.quantize import quantize
    from clover_gguf.runtime import CloverRuntime

    f32 = convert(twins["clover"], twins["root"] / "decode-f32.gguf", outtype="f32", quiet=True, force=True).out
    q4 = twins["root"] / "decode-q4_k_m.gguf"
    quantize(f32, q4, "Q4_K_M", quiet=True)
    text = {}
    with CloverRuntime(q4, n_ctx=512) as rt:
        assert rt.block_mode and not rt.reading_verified  # its reading is unverified: no stamp in its config
        ids = rt.prompt_ids("Count from 3 to 9.", think=False)
        for mode in ("ar", "draft-self", "diffusion"):
            out, stats = "", None
            for piece, stats in rt.stream_ids(ids, mode=mode, max_new_tokens=40):
                out += piece
            assert stats is not None and stats.generated_tokens > 0 and stats.forward_passes > 0, mode
            text[mode] = out
            if mode != "ar":
                assert stats.acceptance_rate is not None or stats.generated_tokens < 32, mode
    assert text["draft-self"] == text["ar"]  # exact acceptance: the causal path decides every token


# the keys only our Python side reads (the card's controls, the diffusion threshold, the reading's stamp): the
# llama.cpp PR's converter class does not write them
PYTHON_ONLY = re.compile(r"^(clover_moe\.generation\..*|diffusion\.threshold|clover_moe\.diffusion\.softmax_form(_verified)?)$")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_the_patched_trees_converter_writes_our_file(make_checkpoint, tmp_path, outtype):
    """The converter class our llama.cpp patch adds (conversion/clover.py with gguf-py's clover_moe constants), run on
    a make_tiny Clover, writes our file key for key and tensor for tensor, the block tensors and block-mode keys
    included: two implementations of one conversion, each the other's check."""
    ck = make_checkpoint(seed=1)
    up_kv, up_t = _kv_and_tensors(upstream_convert(ck, tmp_path / "upstream.gguf", outtype, patched=True))
    ours = convert(ck, tmp_path / "ours.gguf", outtype=outtype, quiet=True).out
    kv, tensors = _kv_and_tensors(ours)
    assert up_kv["general.architecture"][1] == "clover_moe" and up_kv["clover_moe.diffusion.enabled"][1] is True
    mine = {k: v for k, v in kv.items() if not PYTHON_ONLY.match(k)}
    assert mine.keys() - up_kv.keys() <= {"general.sampling.penalty_repeat"}, mine.keys() - up_kv.keys()
    # the size label: ours leaves the block tensors out of the parameter count, so that a checkpoint gets the label
    # upstream's AR converter gives it; the converter class counts every tensor it writes (8x196K against 8x195K)
    assert {k: mine[k] for k in up_kv if k != "general.size_label"} == \
        {k: v for k, v in up_kv.items() if k != "general.size_label"}
    assert len([n for n in tensors if CLOVER_EXTRA_RE.match(n)]) == 4 * 3
    assert tensors.keys() == up_t.keys()
    for n in up_t:
        assert tensors[n] == up_t[n], n  # type, shape and every byte
