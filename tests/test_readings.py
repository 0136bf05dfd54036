"""The readings of the block softmax's tensors (metadata.READINGS, docs/architecture.md 3b): each reading's math
against naive loops, the reading a file carries (convert --reading, the runtime's refusals, restamping a header in
place), check-block --reading all's ranking on the bundled model and --write / graft --pick-reading, and that a reading
wrong for the weights still gives AR's greedy text in draft-self (exact)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import clover_gguf
from clover_gguf import metadata as md
from clover_gguf.convert import convert
from clover_gguf.errors import UserError
from clover_gguf.export import restamp
from clover_gguf.gguf_header import BOOL, STRING, read_header
from clover_gguf.reference import CloverModel, ReferenceBackend, block_softmax, load_gguf

ASSETS = Path(clover_gguf.__file__).parent / "assets"
BUNDLED = ASSETS / "tiny-clover"


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          timeout=900)


# ---- the math ---------------------------------------------------------------------------------------------------
def naive_block_softmax(reading, o_gdn, q, k, v, s0, logit_scale, history_bias, history_c):
    """docs/architecture.md 3b written out with Python loops over sequences, heads, positions and dims."""
    n_seq, t_len, hv, dk = q.shape
    dv = v.shape[-1]
    out = np.zeros(o_gdn.shape)
    for n in range(n_seq):
        for h in range(hv):
            tau, b, c = math.exp(logit_scale[h]), float(history_bias[h]), float(history_c[h])
            for t in range(t_len):
                logits = [tau * sum(q[n, t, h, d] * k[n, j, h, d] for d in range(dk)) for j in range(t_len)] + [b]
                top = max(logits)
                w = [math.exp(x - top) for x in logits]
                z = sum(w)
                o_sm = [sum(w[j] * v[n, j, h, e] for j in range(t_len)) / z for e in range(dv)]
                if reading != "hist-sink-add":  # the history's value: the clean state read by q_t / sqrt(dk)
                    hist = [sum(q[n, t, h, d] * s0[n, h, d, e] for d in range(dk)) / math.sqrt(dk) for e in range(dv)]
                    o_sm = [o_sm[e] + w[t_len] / z * hist[e] for e in range(dv)]
                for e in range(dv):
                    g = o_gdn[n, t, h, e]
                    out[n, t, h, e] = (1 - c) * g + c * o_sm[e] if reading == "hist-read-mix" else g + c * o_sm[e]
    return out


@pytest.mark.parametrize("reading", list(md.READINGS))
def test_each_reading_matches_naive_loops(reading):
    g = torch.Generator().manual_seed(7)
    n, t, hv, dk, dv = 2, 5, 3, 4, 3

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    unit = torch.nn.functional.normalize
    q, k = unit(r(n, t, hv, dk), dim=-1), unit(r(n, t, hv, dk), dim=-1)
    v, o_gdn, s0 = r(n, t, hv, dv), r(n, t, hv, dv), r(n, hv, dk, dv, scale=2.0)
    ls, hb, hc = r(hv, scale=0.5), r(hv), torch.rand(hv, generator=g, dtype=torch.float64)
    got = block_softmax(reading, o_gdn, q, k, v, s0, ls, hb, hc).numpy()
    want = naive_block_softmax(reading, *(x.numpy() for x in (o_gdn, q, k, v, s0, ls, hb, hc)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # the readings are three different functions of the same inputs
    others = [block_softmax(x, o_gdn, q, k, v, s0, ls, hb, hc) for x in md.READINGS if x != reading]
    assert all(float((torch.from_numpy(got) - o).abs().max()) > 1e-3 for o in others)


def test_the_readings_table_is_one_length_and_unknown_names_are_refused():
    assert len({len(x) for x in md.READINGS}) == 1 and md.READING in md.READINGS
    with pytest.raises(UserError, match="unknown block reading 'no-such-form'.*hist-sink-add, hist-read-add"):
        md.check_reading("no-such-form", "--reading")
    model = CloverModel.from_pretrained(BUNDLED)
    with pytest.raises(UserError, match="unknown block reading"):
        model.reading = "sink"


def test_the_model_runs_its_reading(tiny):
    """In a whole model: with no prefix the clean state is zero, so hist-read-add is hist-sink-add exactly; after
    a prefix the three readings give three different block passes; a causal pass never depends on the reading."""
    model = CloverModel.from_pretrained(tiny, dtype=torch.float64)
    assert model.reading == md.READING  # make_tiny's checkpoints are made under the default reading
    mask = model.cfg.mask_token_id
    block, prefix = [mask, 5, mask, 9, mask, mask], [3, 14, 15, 9, 26, 5, 35]
    got = {}
    with torch.no_grad():
        for reading in md.READINGS:
            model.reading = reading
            got[reading] = (model.block_logits(None, block), model.block_logits(prefix, block), model(prefix))
    one, two, three = (got[x] for x in md.READINGS)
    assert torch.equal(one[0], two[0]) and not torch.equal(one[0], three[0])
    assert all(float((a[1] - b[1]).abs().max()) > 1e-6 for a, b in ((one, two), (one, three), (two, three)))
    assert torch.equal(one[2], two[2]) and torch.equal(one[2], three[2])


def test_load_gguf_gives_the_checkpoints_model(make_checkpoint, tmp_path):
    """reference.load_gguf undoes every converter transform: the same weights (to a float32 ulp) and the same
    block logits as the checkpoint, value heads tiled (Hk < Hv) and untied embeddings included; the file's reading."""
    ck = make_checkpoint(seed=3)
    out = tmp_path / "m.gguf"
    convert(ck, out, outtype="f32", quiet=True, reading="hist-read-add")
    a, b = load_gguf(out), CloverModel.from_pretrained(ck)
    assert a.cfg.linear_num_key_heads < a.cfg.linear_num_value_heads and a.reading == "hist-read-add"
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pb.items():
        torch.testing.assert_close(pa[name], p, rtol=2e-7, atol=2e-7, msg=name)
    b.reading = "hist-read-add"
    with torch.no_grad():
        ids, block = [3, 1, 4, 1, 5], [a.cfg.mask_token_id, 9, a.cfg.mask_token_id]
        torch.testing.assert_close(a.block_logits(ids, block), b.block_logits(ids, block), rtol=1e-5, atol=1e-5)


# ---- the reading a file carries ------------------------------------------------------------------------------------
def _data_hash(path: Path) -> str:
    h = read_header(path)
    with open(path, "rb") as f:
        f.seek(h.data_offset)
        return hashlib.sha256(f.read()).hexdigest()


def test_convert_stamps_the_reading_it_is_told_and_refuses_an_unknown_one(tmp_path):
    out = tmp_path / "b.gguf"
    p = _cli("convert", BUNDLED, "-o", out, "--outtype", "f32", "-q", "--reading", "hist-read-mix")
    assert p.returncode == 0, p.stderr
    kv = read_header(out).kv
    assert kv[md.BLOCK_READING] == "hist-read-mix" and kv[md.BLOCK_READING_VERIFIED] is False  # made under -1
    bad = tmp_path / "bad.gguf"
    p = _cli("convert", BUNDLED, "-o", bad, "--outtype", "f32", "-q", "--reading", "no-such-form")
    assert p.returncode == 2 and not bad.exists() and not list(tmp_path.glob(".bad*")), p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown block reading 'no-such-form'" in lines[0] and "Traceback" not in p.stderr
    p = _cli("convert", BUNDLED, "-o", bad, "--arch", "qwen35moe", "--reading", "hist-read-add")
    assert p.returncode == 2 and "--arch qwen35moe writes no block tensors" in p.stderr and not bad.exists()


def test_restamp_in_place_and_by_rewriting(bundled_gguf, tmp_path):
    """Same-size values are written into the header in place (the tensors never move, the size stays); a key that
    is not there makes a copy renamed over the file; no temporary file is left either way."""
    f = tmp_path / "m.gguf"
    shutil.copy(bundled_gguf, f)
    size, data = f.stat().st_size, _data_hash(f)
    assert restamp(f, {md.BLOCK_READING: (STRING, "hist-read-mix"), md.BLOCK_READING_VERIFIED: (BOOL, True)}) \
        == "in place"
    h = read_header(f)
    assert h.kv[md.BLOCK_READING] == "hist-read-mix" and h.kv[md.BLOCK_READING_VERIFIED] is True
    assert f.stat().st_size == size and _data_hash(f) == data
    stamped = (md.BLOCK_READING, md.BLOCK_READING_VERIFIED)
    assert {k: v for k, v in h.kv.items() if k not in stamped} == \
        {k: v for k, v in read_header(bundled_gguf).kv.items() if k not in stamped}
    assert restamp(f, {md.BLOCK_READING: (STRING, "a-longer-reading-name"), "clover_moe.test.note": (STRING, "x")}) \
        == "rewritten"
    h = read_header(f)
    assert h.kv[md.BLOCK_READING] == "a-longer-reading-name" and h.kv["clover_moe.test.note"] == "x"
    assert list(tmp_path.iterdir()) == [f]
    with open(f, "rb") as fh:  # the tensors, byte for byte (their offsets moved with the longer header)
        fh.seek(h.data_offset)
        assert hashlib.sha256(fh.read()).hexdigest() == data


def _legacy_copy(src: Path, out: Path, reading: str, names: dict[str, str] = md.LEGACY_KEYS_ARCH) -> Path:
    """A copy of `src` with the block-mode keys under one generation of earlier names (`names`, old -> new) and
    `reading` under the name it had then: what clover-gguf wrote up to 2026-12-05 (LEGACY_KEYS_ARCH, the readings'
    earlier names) or up to 2026-12-07 (LEGACY_KEYS_DIFFUSION, the arch-less diffusion.* names)."""
    from clover_gguf.export import copy_gguf

    h = read_header(src, full=True)
    old = {new: legacy for legacy, new in names.items()}
    was = {new: legacy for legacy, new in md.LEGACY_READINGS.items()} if names is md.LEGACY_KEYS_ARCH else {reading: reading}
    copy_gguf(h, src, out, keep=list(h.tensors), rename={k: old[k] for k in h.kv if k in old},
              drop_keys={md.BLOCK_READING}, add_keys={old[md.BLOCK_READING]: (STRING, was[reading])}, quiet=True)
    return out


@pytest.mark.parametrize("names, old_mode_key", [(md.LEGACY_KEYS_ARCH, "clover_moe.block_mode"),
                                                  (md.LEGACY_KEYS_DIFFUSION, "diffusion.enabled")],
                         ids=["arch-block-names", "arch-less-diffusion-names"])
def test_a_file_of_the_earlier_key_names_keeps_loading(bundled_gguf, tmp_path, names, old_mode_key):
    """A GGUF of an earlier generation of block mode's key names (up to 2026-12-05: clover_moe.block_mode, ...,
    block_reading = "clover-gguf-3"; up to 2026-12-07: the arch-less diffusion.enabled, ..., diffusion.softmax_form
    = "hist-read-mix", before Clover's own keys moved under the architecture): its header reads with the new names and
    values (read_header), and llama.cpp, which knows only the new names, gets them as overrides at load
    (LlamaContext): block attention on, the file's reading (hist-read-mix here, not the default) in force, a block
    pass equal to the same model stamped with the new names."""
    from clover_gguf.llama_context import LlamaContext

    new = tmp_path / "new.gguf"
    shutil.copy(bundled_gguf, new)
    restamp(new, {md.BLOCK_READING: (STRING, "hist-read-mix")})
    old = _legacy_copy(new, tmp_path / "old.gguf", "hist-read-mix", names)
    raw = read_header(old).spans  # the file's own names
    assert old_mode_key in raw and md.BLOCK_MODE not in raw
    h = read_header(old)
    assert h.kv[md.BLOCK_MODE] is True and h.kv[md.BLOCK_READING] == "hist-read-mix"
    assert not any(k in h.kv for k in md.LEGACY_KEYS)
    assert h.upgraded[md.BLOCK_READING] == "hist-read-mix" and h.upgraded[md.BLOCK_MODE] is True
    rows = []
    for path in (new, old):
        r = LlamaContext(path, n_ctx=256, n_ubatch=256, n_threads=2, exact=True)
        try:
            assert r.has_block_attn, path.name
            r.decode(list(range(10, 30)), 0, 0)
            rows.append(r.block([7, 8, 9, 10, 11, 12], 20))
        finally:
            r.close()
    assert np.array_equal(rows[0], rows[1])
    # the default reading would give other logits: the file's reading is the one in force
    r = LlamaContext(old, n_ctx=256, n_ubatch=256, n_threads=2, exact=True, overrides={md.BLOCK_READING: md.READING})
    try:
        r.decode(list(range(10, 30)), 0, 0)
        assert not np.array_equal(r.block([7, 8, 9, 10, 11, 12], 20), rows[0])
    finally:
        r.close()


def test_a_file_under_another_reading_decodes_under_it_with_ar_text(bundled_gguf, tmp_path):
    """llama.cpp computes every reading (patches/0005, clover_moe.diffusion.softmax_form): a copy of the bundled model stamped
    hist-read-mix runs its block modes under that reading, and draft-self (exact) and auto still write AR's text."""
    f = tmp_path / "r3-stamped.gguf"
    shutil.copy(bundled_gguf, f)
    restamp(f, {md.BLOCK_READING: (STRING, "hist-read-mix")})
    args = ("-p", "Count from 3 to 9.", "--no-think", "-n", "24")
    ar = _cli("generate", bundled_gguf, *args, "--mode", "ar")
    assert ar.returncode == 0, ar.stderr
    for extra in (("--mode", "draft-self", "--accept", "exact"), (), ("--mode", "auto")):
        p = _cli("generate", f, *args, *extra, "--stats")
        assert p.returncode == 0 and p.stdout == ar.stdout, (extra, p.stderr)
        assert "auto decodes AR" not in p.stderr


def test_a_reading_the_backend_does_not_run_refuses_block_modes_and_auto_decodes_ar(bundled_gguf, monkeypatch):
    """A backend that lacks the file's reading (MLX's runs hist-sink-add only; here llama.cpp's told so): block modes
    are refused in one line, auto decodes AR with one note."""
    from clover_gguf.runtime import CloverRuntime, LlamaBackend

    monkeypatch.setattr(LlamaBackend, "READINGS", ("hist-sink-add",))
    with CloverRuntime(bundled_gguf, reading="hist-read-mix") as rt:
        assert not rt.runs_reading
        for mode in ("draft-self", "diffusion"):
            with pytest.raises(UserError, match=f"hist-read-mix.*--mode {mode} cannot run.*check-block"):
                rt.generate("Count from 3 to 9.", mode=mode, max_new_tokens=8)
        assert "auto decodes AR" in rt.reading_note("auto")


# ---- a wrong reading: the same text, only slower ----------------------------------------------------------------
def test_a_wrong_reading_still_gives_ar_text_in_draft_self_exact(bundled_eval, tmp_path):
    """Block tensors read under a reading that does not fit them (the bundled model's replaced by random values,
    under every reading; the reference backend runs them all): draft-self (exact) writes AR's greedy tokens on every
    prompt; only the accepted share falls."""
    from tokenizers import Tokenizer

    from clover_gguf.decoding import generate_all
    from clover_gguf.testing.make_tiny import with_random_block_tensors
    from clover_gguf.testing.train_tiny import row_conversation

    model = CloverModel.from_pretrained(with_random_block_tensors(BUNDLED, tmp_path / "random"))
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    backend = ReferenceBackend(model)
    rows = [r for r in bundled_eval if "history" not in r][::40]
    for reading in md.READINGS:
        model.reading = reading
        drafted = kept = 0
        for row in rows:
            ids = tok.encode(row_conversation(row).prompt_text()).ids
            ar, _ = generate_all(backend, ids, mode="ar", max_new_tokens=24)
            ds, st = generate_all(backend, ids, mode="draft-self", accept="exact", max_new_tokens=24)
            assert ds == ar, (reading, row["prompt"])
            drafted, kept = drafted + st.drafted_tokens, kept + st.accepted_tokens
        print(reading, "accepted", kept, "of", drafted)
        assert drafted > 0 and kept / drafted < 0.5


# ---- check-block --reading all ------------------------------------------------------------------------------------
def test_check_block_ranks_hist_sink_add_first_on_the_bundled_model(bundled_gguf):
    """The bundled model was trained under hist-sink-add. Its history logits are -10000 (the slot never takes any
    weight), so hist-read-add is the same function there, and hist-read-mix (c_h 0.07-0.55) drafts the same tokens in
    the same passes: the three tie exactly, and check-block names no winner by a tie (issue 64: it printed "best:
    hist-sink-add ... +0.0%"): it says they cannot be told apart on these prompts and what would separate them."""
    p = _cli("check-block", bundled_gguf, "--reading", "all", "-n", "48", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    print("bundled:", [(r["reading"], r["acceptance"], r["accepted_per_pass"]) for r in res["ranking"]])
    assert res["winner"] is None and res["tied"] == list(md.READINGS), res
    assert res["verdict"] == "holds" and res["written"] is None
    assert [r["reading"] for r in res["ranking"]] == list(md.READINGS)
    assert {r["backend"] for r in res["ranking"]} == {"llama.cpp"}  # it computes every reading
    assert all(r["prompts"] == 12 for r in res["ranking"])  # one check-block run per reading
    one = res["ranking"][0]
    assert one["acceptance"] >= 0.95 and all((r["accepted"], r["drafted"], r["block_passes"]) ==
                                             (one["accepted"], one["drafted"], one["block_passes"])
                                             for r in res["ranking"])
    text = _cli("check-block", bundled_gguf, "--reading", "all", "-n", "48").stdout
    assert "best:" not in text and re.search(
        rf"^no best reading: hist-sink-add, hist-read-add and hist-read-mix cannot be told apart on these 12 prompts "
        rf".*: {one['accepted']} of {one['drafted']} drafts accepted each\nwhat would separate them: prompts on which "
        rf"their block passes draft differently", text, re.M), text


def _result(reading: str, accepted: int, drafted: int, passes: int):
    from clover_gguf.check_block import CheckResult

    return CheckResult("m.gguf", reading, False, drafted=drafted, accepted=accepted, block_passes=passes,
                       per_prompt=[{}] * 12, prompt_set="bundled")


def test_a_ranking_names_a_winner_only_beyond_the_counts_noise():
    """Ties: the same counts; 3 more drafts of 230 (1.3 points: two standard errors are 2.6) with tokens per pass
    within 10%. Apart: 17 points, or the same share at half the passes. --write's pick in a tie is the file's own
    reading when it is among the tied, else none."""
    from clover_gguf.check_block import Ranking, indistinguishable

    a = _result("hist-sink-add", 227, 229, 20)
    assert indistinguishable(a, _result("hist-read-add", 227, 229, 20))
    assert indistinguishable(_result("x", 224, 230, 20), _result("y", 227, 230, 21))
    assert not indistinguishable(_result("x", 226, 234, 37), _result("y", 218, 276, 84))
    assert not indistinguishable(_result("x", 227, 229, 20), _result("y", 227, 229, 40))
    tie = Ranking("m.gguf", "hist-read-mix", [a, _result("hist-read-mix", 227, 229, 20),
                                              _result("hist-read-add", 100, 229, 40)])
    assert tie.winner is None and [r.reading for r in tie.tied] == ["hist-sink-add", "hist-read-mix"]
    assert tie.pick.reading == "hist-read-mix" and "best:" not in tie.format()
    assert Ranking("m.gguf", "hist-read-add", tie.results).pick is None
    clear = Ranking("m.gguf", "hist-read-add", [a, _result("hist-read-add", 100, 229, 40)])
    assert clear.winner is a and clear.format().splitlines()[3].startswith("best: hist-sink-add")


@pytest.fixture(scope="module")
def reading3_gguf(tmp_path_factory):
    """The test model trained under hist-read-mix (train_tiny.READING3_RUN: the bundled model fine-tuned with its
    history slot and history_c where the readings disagree), converted to F32: its file says hist-read-mix."""
    from clover_gguf.testing import train_tiny

    folder = tmp_path_factory.mktemp("reading3") / "model"
    train_tiny.train(folder, log=False, **train_tiny.READING3_RUN)
    out = folder.parent / "reading3.gguf"
    convert(folder, out, outtype="f32", quiet=True)
    return out


@pytest.mark.slow  # trains the model: about 6 minutes on two cores
def test_check_block_ranks_hist_read_mix_first_on_a_model_trained_under_it(reading3_gguf):
    """check-block --reading all on a model trained under hist-read-mix: its reading first, by a wide margin (at
    least 10 points of acceptance over each other reading, and half again as many accepted tokens per block pass;
    measured: 96.6% and 6.1 per pass against 79.0% and 2.6 for hist-sink-add and 41.8% and 1.6 for hist-read-add),
    each reading decoded once on llama.cpp."""
    assert read_header(reading3_gguf).kv[md.BLOCK_READING] == "hist-read-mix"
    p = _cli("check-block", reading3_gguf, "--reading", "all", "-n", "48", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    print("trained under hist-read-mix:", [(r["reading"], r["acceptance"]) for r in res["ranking"]])
    assert res["winner"] == "hist-read-mix" and res["verdict"] == "holds"
    best, *others = res["ranking"]
    assert res["margin"] >= 0.10 and all(best["accepted_per_pass"] >= 1.5 * r["accepted_per_pass"] for r in others)
    assert {r["backend"] for r in res["ranking"]} == {"llama.cpp"} and all(r["prompts"] == 12 for r in res["ranking"])


def _unverified_checkpoint(tmp_path: Path) -> Path:
    """The bundled checkpoint without its reading field: what the real checkpoint looks like to us."""
    ck = tmp_path / "unverified"
    shutil.copytree(BUNDLED, ck)
    cfg = json.loads((ck / "config.json").read_text())
    del cfg[md.READING_FIELD]
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def test_check_block_write_stamps_a_reading_that_holds_in_place(tmp_path, bundled_eval):
    f = tmp_path / "m.gguf"
    convert(_unverified_checkpoint(tmp_path), f, outtype="f32", quiet=True)
    assert read_header(f).kv[md.BLOCK_READING_VERIFIED] is False
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in bundled_eval[:4]))
    size, data = f.stat().st_size, _data_hash(f)
    p = _cli("check-block", f, "--reading", "all", "--prompts", prompts, "-n", "32", "--write")
    assert p.returncode == 0, p.stderr
    assert f"wrote {md.BLOCK_READING} = hist-sink-add into m.gguf (in place)" in p.stdout, p.stdout
    kv = read_header(f).kv
    assert kv[md.BLOCK_READING] == "hist-sink-add" and kv[md.BLOCK_READING_VERIFIED] is True
    assert f.stat().st_size == size and _data_hash(f) == data and list(tmp_path.glob(".m.gguf*")) == []
    p = _cli("check-block", f, "--prompts", prompts, "-n", "32", "--write", "--json")
    assert json.loads(p.stdout)["written"].startswith("nothing written: hist-sink-add is the file's reading")


def test_graft_pick_reading_ranks_and_stamps_the_file_it_writes(bundled_gguf, tmp_path, bundled_eval):
    from clover_gguf.export import export_ar

    official = tmp_path / "official.gguf"
    export_ar(bundled_gguf, official, quiet=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in bundled_eval[:3]))
    out = tmp_path / "grafted.gguf"
    p = _cli("graft", official, "--from", _unverified_checkpoint(tmp_path), "-o", out, "-q", "--pick-reading",
             "--prompts", prompts, "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert [r["reading"] for r in res["ranking"]["ranking"]][0] == "hist-sink-add"
    assert res["ranking"]["written"] == "in place" and len(res["ranking"]["ranking"]) == len(md.READINGS)
    assert read_header(out).kv[md.BLOCK_READING_VERIFIED] is True
    bad = tmp_path / "bad.txt"
    bad.write_text("\n\n")
    p = _cli("graft", official, "--from", BUNDLED, "-o", tmp_path / "never.gguf", "--pick-reading", "--prompts", bad)
    assert p.returncode == 2 and "holds no prompt" in p.stderr and not (tmp_path / "never.gguf").exists()


def test_check_block_reading_option_is_checked_first(bundled_gguf):
    p = _cli("check-block", bundled_gguf, "--reading", "sinks")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "unknown block reading 'sinks'" in lines[0], p.stderr
