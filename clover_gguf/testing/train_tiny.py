"""Train the tiny Clover that the demo and the tests use, on the reference model, on CPU.

    python -m clover_gguf.testing.train_tiny OUT [--steps N] [--seed S] [--threads T] [--resume]
        [--reading NAME] [--init-from DIR] [--history-c C] [--history-bias B]
    python -m clover_gguf.testing.train_tiny OUT --eval-only [--mode ar|diffusion|draft-self] [--limit N]

Synthetic chat tasks with checkable answers (counting, addition, reversing/copying letters, key -> value
recall) in conversations of 1-3 turns, rendered with the chat template as the runtime renders them: earlier
answers appear without their thinking, and the answered (last) turn either thinks (a fixed short thinking span) or
follows the empty thinking span that `enable_thinking=False` puts into the prompt. Tokenized with a small byte-level
BPE trained here.

Objective per step (two micro-batches):
  * causal next-token loss on the answered assistant turn (thinking, answer, <|im_end|>), and on the earlier
    answers in the history after their first token (history_targets);
  * block-diffusion loss, BD3-LM / SDAR style: a clean prefix (prompt + part of the answer) is run causally, then
    one block of `block_size` tokens follows in *block mode* (spec section 3: right convolution, intra-block
    softmax, bidirectional attention, coreset routing) with a random share t ~ U(0, 1) of its positions replaced
    by the mask token; cross-entropy on the masked positions. Block positions past the answer's end hold
    <|endoftext|>, so the model learns to fill the tail of a last block with end tokens.

The reference model takes one prefix length per batch, so each micro-batch holds sequences whose block starts at
the same position: either all blocks start right at the answer (same prompt length), or at one shared position
inside the answers. Conversations come from a pool drawn once from the seed (bucketed by prompt length), batches
from generators seeded by (seed, step), so --resume continues exactly. OUT/train_state.pt holds model + optimizer
every --save-every steps; the finished checkpoint is written to OUT.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from clover_gguf.metadata import READING, READING_FIELD, READINGS, check_reading

THINK = "<think>\nLet me work it out.\n</think>\n\n"  # the fixed thinking span before every thinking answer
WORDS = ["apple", "sky", "cat", "dog", "tree", "moon", "fish", "star", "rock", "lamp", "cup", "book", "rain",
         "leaf", "ship", "bird", "door", "milk", "sand", "king"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"
TASKS = ("count", "add", "reverse", "copy", "recall")
# training draws addition twice as often for the answered turn: carries are what the model learns last (the other
# four tasks were at 29-30 of 30 while addition was at 26 of 30 in the first checkpoint)
TASK_WEIGHTS = (1, 2, 1, 1, 1)
ONE_DIGIT_SHARE = 0.25  # an addition operand is 0-9 this often, else 10-99 ("What is 7 + 8?" must work too)
TURN_WEIGHTS = (2, 1, 1)  # conversations of 1, 2 and 3 turns
NO_THINK_SHARE = 0.3  # answered with enable_thinking=False (the prompt holds the empty thinking span)
HOLDOUT_MOD = 16  # prompts whose crc32 % HOLDOUT_MOD == 0 are held out (never trained on, in any turn)
EVAL_ROWS = {"single": 30, "multi": 15, "no-think": 15}  # eval rows per task and row kind
ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-clover"  # the committed checkpoint


# ---------------------------------------------------------------------------------------------------------------
# Tasks and conversations
# ---------------------------------------------------------------------------------------------------------------
def make_task(rng: random.Random, task: str) -> tuple[str, str]:
    """-> (user prompt, answer text after the thinking span)."""
    if task == "count":
        a = rng.randint(0, 95)
        b = a + rng.randint(2, 7)
        return f"Count from {a} to {b}.", " ".join(str(i) for i in range(a, b + 1))
    if task == "add":
        a, b = (rng.randint(0, 9) if rng.random() < ONE_DIGIT_SHARE else rng.randint(10, 99) for _ in range(2))
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}"
    if task in ("reverse", "copy"):
        s = [rng.choice(LETTERS) for _ in range(rng.randint(3, 6))]
        out = s[::-1] if task == "reverse" else s
        return f"{task.capitalize()}: {' '.join(s)}", " ".join(out)
    if task == "recall":
        keys = rng.sample(WORDS, rng.randint(2, 4))
        vals = [rng.randint(0, 9) for _ in keys]
        q = rng.randrange(len(keys))
        pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, vals))
        return f"Keys: {pairs}. What is {keys[q]}?", f"{keys[q]} = {vals[q]}"
    raise ValueError(task)


def is_held_out(prompt: str) -> bool:
    return zlib.crc32(prompt.encode()) % HOLDOUT_MOD == 0


def draw_task(rng: random.Random, task: str, held_out: bool) -> tuple[str, str]:
    """make_task until the prompt is on the wanted side of the hold-out rule."""
    while True:
        p, a = make_task(rng, task)
        if is_held_out(p) == held_out:
            return p, a


@dataclass(frozen=True)
class Conversation:
    """Turns (user prompt, answer); the last one is the turn answered, the earlier ones are history."""

    turns: tuple[tuple[str, str], ...]
    think: bool = True

    @property
    def prompt(self) -> str:
        return self.turns[-1][0]

    @property
    def answer(self) -> str:
        return self.turns[-1][1]

    @property
    def history(self) -> list[dict[str, str]]:
        """Earlier turns as chat messages; an earlier answer is its text alone (the template drops thinking)."""
        return [{"role": r, "content": c} for p, a in self.turns[:-1] for r, c in (("user", p), ("assistant", a))]

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.history + [{"role": "user", "content": self.prompt}]

    def prompt_text(self) -> str:
        return chat_prompt(self.messages, self.think)

    def target_text(self) -> str:
        """What the model is trained to generate after the prompt: thinking (when on), answer, end token."""
        return (THINK if self.think else "") + self.answer + "<|im_end|>"


def draw_conversation(rng: random.Random, held_out: bool = False, last_task: str | None = None,
                      n_turns: int | None = None, think: bool | None = None) -> Conversation:
    """A conversation of 1-3 turns (TURN_WEIGHTS); every prompt on the given side of the hold-out rule."""
    n_turns = n_turns or rng.choices((1, 2, 3), TURN_WEIGHTS)[0]
    if think is None:
        think = rng.random() >= NO_THINK_SHARE
    last_task = last_task or rng.choices(TASKS, TASK_WEIGHTS)[0]
    turns = [draw_task(rng, rng.choice(TASKS), held_out) for _ in range(n_turns - 1)]
    return Conversation(tuple(turns + [draw_task(rng, last_task, held_out)]), think)


_TEMPLATE = None


def chat_prompt(messages: list[dict[str, str]] | str, think: bool = True) -> str:
    """The chat template (clover_gguf.testing.tokenizer.CHAT_TEMPLATE) with add_generation_prompt, rendered as
    CloverRuntime.render renders a GGUF's template (a test checks the two agree). A string is one user turn."""
    global _TEMPLATE
    if _TEMPLATE is None:
        import jinja2.sandbox

        from clover_gguf.testing.tokenizer import CHAT_TEMPLATE

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
        _TEMPLATE = env.from_string(CHAT_TEMPLATE)
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return _TEMPLATE.render(messages=list(messages), add_generation_prompt=True, enable_thinking=think)


def strip_thinking(text: str) -> str:
    from clover_gguf.thinking import split_thinking

    return split_thinking(text)[1]


def row_kind(row: dict) -> str:
    """An eval row's kind: "no-think" (answered with thinking off), "multi" (history before it) or "single"."""
    if not row.get("think", True):
        return "no-think"
    return "multi" if row.get("history") else "single"


def row_conversation(row: dict) -> Conversation:
    hist = row.get("history", [])
    turns = [(hist[i]["content"], hist[i + 1]["content"]) for i in range(0, len(hist), 2)]
    return Conversation(tuple(turns + [(row["prompt"], row["answer"])]), row.get("think", True))


def make_eval_set(per_task: dict[str, int] = EVAL_ROWS, seed: int = 12345) -> list[dict]:
    """Held-out rows: every prompt in them, history included, is held out (so no training conversation has it).
    Kinds in order: single (one thinking turn), multi (2-3 turns, thinking), no-think (1-3 turns, thinking off);
    within a kind, tasks in TASKS order. A row: prompt, answer, and history / think when not single."""
    rng, out = random.Random(seed), []
    for kind, n_per_task in per_task.items():
        seen = set()  # last prompts are distinct within a kind (counting has only ~36 held-out prompts)
        for task in TASKS:
            n = 0
            while n < n_per_task:
                turns = 1 if kind == "single" else rng.choice((2, 3)) if kind == "multi" else rng.choice((1, 2, 3))
                c = draw_conversation(rng, held_out=True, last_task=task, n_turns=turns, think=kind != "no-think")
                if c.prompt in seen:
                    continue
                seen.add(c.prompt)
                row = {"prompt": c.prompt, "answer": c.answer}
                if c.history:
                    row["history"] = c.history
                if not c.think:
                    row["think"] = False
                out.append(row)
                n += 1
    return out


def corpus_text(draw: Callable[[random.Random, int], Any], n: int, seed: int) -> str:
    """A family's BPE training text: n conversations, the i-th drawn by draw(rng, i) from one seeded generator,
    each rendered prompt and target, a line apart."""
    rng = random.Random(seed)
    return "".join(c.prompt_text() + c.target_text() + "\n" for c in (draw(rng, i) for i in range(n)))


def bpe_corpus(n: int = 1500, seed: int = 7) -> str:
    return corpus_text(lambda rng, i: draw_conversation(rng, last_task=TASKS[i % len(TASKS)]), n, seed)


def _chat_template() -> str:
    from clover_gguf.testing.tokenizer import CHAT_TEMPLATE

    return CHAT_TEMPLATE


@dataclass(frozen=True)
class Family:
    """A family of training tasks: what a model of this script is trained on, and the files that say it.
    draw(rng) -> a conversation with prompt_text() and target_text(); corpus() -> the BPE training text;
    eval_set() -> the held-out rows of eval.jsonl; template() -> the chat template; n_merges, exact_split: the
    tokenizer's training (tokenizer.train_bpe)."""

    name: str
    draw: Callable[[random.Random], Any]
    corpus: Callable[[], str]
    eval_set: Callable[[], list[dict]]
    template: Callable[[], str]
    n_merges: int = 120
    exact_split: bool = False


# the bundled model's tasks (the tool-calling model's: clover_gguf.testing.tool_tasks.FAMILY)
BUNDLED = Family(name="bundled", draw=draw_conversation, corpus=bpe_corpus, eval_set=make_eval_set,
                 template=_chat_template)


# ---------------------------------------------------------------------------------------------------------------
# Model setup
# ---------------------------------------------------------------------------------------------------------------
SHAPE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
             shared_expert_intermediate_size=64)


def make_config(special: dict[str, int], vocab_size: int):
    from clover_gguf.config import CloverConfig

    n = SHAPE["num_hidden_layers"]
    d = dict(SHAPE, vocab_size=vocab_size, model_type="clover_moe",
             layer_types=["full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(n)],
             full_attention_interval=2,  # two attention layers of four: copying and recall are learnt much faster
             rope_parameters={"rope_theta": 10_000.0, "partial_rotary_factor": 0.5}, tie_word_embeddings=False,
             max_position_embeddings=4096, eos_token_id=[special["<|im_end|>"], special["<|endoftext|>"]],
             pad_token_id=special["<|endoftext|>"], mask_token_id=special["<|mask|>"], block_size=32,
             linear_conv_right_kernel_dim=4, moe_block_coreset_enabled=True, moe_block_coreset_top_p=0.9)
    return CloverConfig.from_dict(d)


def init_model(cfg, seed: int):
    """Random weights from make_tiny's init table (same scales), loaded into the reference model."""
    import torch

    from clover_gguf.reference import CloverModel
    from clover_gguf.testing.make_tiny import checkpoint_tensors, generate

    tensors = {}
    for name, shape, init in checkpoint_tensors(cfg):
        tensors[name] = torch.from_numpy(generate(name, shape, init, seed))
    for i in range(cfg.num_hidden_layers):  # per-expert -> stacked, as clover_gguf.checkpoint does
        p = f"model.layers.{i}.mlp.experts."
        for n in ("gate_proj", "up_proj", "down_proj"):
            tensors[p + n] = torch.stack([tensors.pop(f"{p}{e}.{n}.weight") for e in range(cfg.num_experts)])
    model = CloverModel(cfg)
    model.load_hf_state_dict(tensors)
    return model


BLOCK_SOFTMAX = ("bd_softmax_logit_scale", "bd_softmax_history_bias", "bd_softmax_history_c")


def start_from(model, folder: Path) -> None:
    """Load a checkpoint's weights into `model` (train --init-from), all but the block-softmax tensors, which keep
    their fresh random values (make_tiny's init table)."""
    import torch

    from clover_gguf import checkpoint

    if json.loads((folder / "config.json").read_text()).get("vocab_size") != model.cfg.vocab_size:
        raise SystemExit(f"--init-from {folder}: not a checkpoint of this script's shape and tokenizer")
    tensors = checkpoint.load_hf_tensors(folder)
    own = model.hf_state_dict(experts="fused")
    for name in list(tensors):
        if name.rsplit(".", 1)[-1] in BLOCK_SOFTMAX:
            tensors[name] = own[name]
    model.load_hf_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()})


# The test model trained under hist-read-mix (tests/test_readings.py; docs/tiny-model.md): the bundled model fine-tuned
# under that reading, its history slot given the whole block softmax and history_c 3, for 300 steps (about 6 minutes
# on two cores). The command line: OUT --init-from clover_gguf/assets/tiny-clover --reading hist-read-mix
# --history-c 3 --history-bias 20 --steps 300 --seed 1 --lr 1e-3 --pool 20000
READING3_RUN = dict(steps=300, seed=1, lr=1e-3, pool=20_000, reading="hist-read-mix", init_from=ASSET_DIR,
                    history_c=3.0, history_bias=20.0)


def set_history(model, history_c: float | None = None, history_bias: float | None = None) -> None:
    """Every GDN layer's bd_softmax_history_c / _history_bias set to one value (per value head) before training.

    Why: on a model started from make_tiny's draw (or the bundled model) the three readings are nearly one function:
    the block softmax's readout over the block is some ten times the delta rule's output and the prefix state's
    readout (the history's value) a tenth of it, and the gated RMSNorm after them keeps only their direction, so
    the readings differ by little and draft alike (docs/tiny-model.md, "Readings"). A
    history bias far above the block's logits gives the history slot the whole softmax (readings 2 and 3 then read
    the prefix state, reading 1's sink takes it away), and a history_c past 1 gives the delta rule's output the
    opposite sign under reading 3 ((1 - c) o_gdn) to readings 1 and 2 (+ o_gdn): weights on which the readings
    disagree, so that check-block has something to find."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if history_c is not None and name.endswith("bd_softmax_history_c"):
                p.fill_(float(history_c))
            if history_bias is not None and name.endswith("bd_softmax_history_bias"):
                p.fill_(float(history_bias))


def save_checkpoint(model, out: Path) -> None:
    from clover_gguf.metadata import GenerationDefaults
    from clover_gguf.testing.make_tiny import write_safetensors

    cfg = model.cfg
    tensors = [(k, "F32", tuple(v.shape), v.float().numpy()) for k, v in model.hf_state_dict().items()]
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1) + "\n")
    gen = {**GenerationDefaults().to_hf(), "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Training-time fast path: the same functions as the reference, computed in parallel (checked in tests)
# ---------------------------------------------------------------------------------------------------------------
def parallel_delta_rule(q, k, v, g, beta, s0):
    """The gated delta rule of the reference loop, all T tokens at once.

    q, k [N, T, H, dk] (q already scaled), v [N, T, H, dv], g, beta [N, T, H], s0 [N, H, dk, dv]
    -> (o [N, T, H, dv], final state [N, H, dk, dv]).
    With G_t = sum_{i<=t} g_i and the per-token update delta_t = beta_t (v_t - (e^{g_t} S_{t-1})^T k_t):
      (I + L) Delta = beta V - beta e^{G} K S0,  L[t, j] = beta_t e^{G_t - G_j} k_t.k_j  (j < t)
      o_t = e^{G_t} q_t^T S0 + sum_{j<=t} e^{G_t - G_j} (q_t.k_j) delta_j
      S_T = e^{G_T} S0 + sum_j e^{G_T - G_j} k_j delta_j^T
    """
    import torch

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [N, H, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [N, H, T]
    t = q.shape[2]
    G = g.cumsum(-1)
    tri = torch.ones(t, t, dtype=torch.bool).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, float("-inf"))
    decay = diff.exp()  # [N, H, T, T], e^{G_t - G_j} for j <= t else 0
    eG = G.exp()[..., None]  # [N, H, T, 1]
    L = (beta[..., None] * decay * (k @ k.transpose(-1, -2))).tril(-1)
    rhs = beta[..., None] * (v - eG * (k @ s0))
    eye = torch.eye(t, dtype=q.dtype)
    delta = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)  # [N, H, T, dv]
    o = eG * (q @ s0) + (decay * (q @ k.transpose(-1, -2))) @ delta
    w = (G[..., -1:] - G).exp()[..., None]  # [N, H, T, 1]
    s = G[..., -1].exp()[..., None, None] * s0 + (k * w).transpose(-1, -2) @ delta
    return o.transpose(1, 2), s


def _fast_moe_forward(self, x, coreset_top_p):
    """reference.SparseMoe.forward as three matrix products over all experts at once: every row through every
    expert, each expert's output weighted by the row's routing weight (zero where it was not chosen), as the
    reference's loop computes it, but without its per-expert passes. (Gathering each expert's rows did a quarter of
    the FLOPs, but its backward, a scatter-add, took a third of a step on the tool family's 300-token sequences.)"""
    import torch
    import torch.nn.functional as F

    idx, w = self.route(x, coreset_top_p)
    n_exp, width, hidden = self.gate_proj.shape
    flat = x.reshape(-1, hidden)  # [N*T, H]
    k = idx.shape[-1]
    dense = torch.zeros(flat.shape[0], n_exp, dtype=w.dtype).scatter(1, idx.reshape(-1, k), w.reshape(-1, k))
    gate = flat @ self.gate_proj.reshape(n_exp * width, hidden).T  # [N*T, E*F]
    up = flat @ self.up_proj.reshape(n_exp * width, hidden).T
    hid = (F.silu(gate) * up).reshape(-1, n_exp, width) * dense[:, :, None]
    out = hid.reshape(-1, n_exp * width) @ self.down_proj.transpose(1, 2).reshape(n_exp * width, hidden)
    out = out.reshape(x.shape)
    shared = self.shared_down_proj(F.silu(self.shared_gate_proj(x)) * self.shared_up_proj(x))
    return out + torch.sigmoid(self.shared_expert_gate(x)) * shared


@contextlib.contextmanager
def fast_path():
    """While inside: the reference model's delta rule and MoE layers use the parallel forms above (restored on
    exit, also when the body raises)."""
    from clover_gguf import reference

    saved = reference.GatedDeltaNet.delta_rule, reference.SparseMoe.forward
    reference.GatedDeltaNet.delta_rule = staticmethod(parallel_delta_rule)
    reference.SparseMoe.forward = _fast_moe_forward
    try:
        yield
    finally:
        reference.GatedDeltaNet.delta_rule = staticmethod(saved[0])
        reference.SparseMoe.forward = saved[1]


# ---------------------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Example:
    prompt: list[int]  # the rendered conversation up to the answered turn's assistant header (and empty thinking)
    answer: list[int]  # thinking (when on) + answer + <|im_end|>
    history_targets: tuple[int, ...] = ()  # prompt positions with a causal loss: earlier answers (see history_targets)


def history_targets(prompt: list[int], header: list[int], end: int) -> tuple[int, ...]:
    """The positions of the earlier answers in a prompt that carry a causal loss: each answer's tokens after its
    first, and its <|im_end|>. The first is left out: after the assistant header the answered turn starts with
    <think> (thinking on) while a history answer starts at once, and the model is not to learn the latter."""
    out, n = [], len(header)
    for h in range(len(prompt) - n + 1):
        if prompt[h:h + n] == header and end in prompt[h + n:]:
            e = prompt.index(end, h + n)
            out += range(h + n + 1, e + 1)
    return tuple(out)


class Data:
    """A pool of `size` training conversations drawn once from `seed` (no held-out prompt in any turn), tokenized,
    with their prompt and answer lengths as arrays so a micro-batch finds the sequences that fit its block
    position without drawing conversations until one fits."""

    def __init__(self, tok, size: int, seed: int, family: Family = BUNDLED):
        import numpy as np

        rng = random.Random(seed * 7_919 + 1)
        convs = [family.draw(rng) for _ in range(size)]
        prompts = tok.encode_batch([c.prompt_text() for c in convs])
        answers = tok.encode_batch([c.target_text() for c in convs])
        header, end = tok.encode("<|im_start|>assistant\n").ids, tok.token_to_id("<|im_end|>")
        self.examples = [Example(p.ids, a.ids, history_targets(p.ids, header, end)) for p, a in zip(prompts, answers)]
        self.lp = np.array([len(e.prompt) for e in self.examples])
        self.la = np.array([len(e.answer) for e in self.examples])

    def _pick(self, rng: random.Random, anchor: int, fits, n: int) -> list[Example]:
        """The anchor and up to n - 1 other pool entries where `fits` (a boolean array) holds."""
        import numpy as np

        fits = fits.copy()
        fits[anchor] = False
        idx = np.flatnonzero(fits)
        others = [int(idx[i]) for i in rng.sample(range(len(idx)), min(n - 1, len(idx)))]
        return [self.examples[anchor]] + [self.examples[i] for i in others]

    def micro_batch(self, rng: random.Random, n: int, block: int, boundary_share: float = 0.0
                    ) -> tuple[list[Example], int]:
        """Up to n examples whose block starts at one shared position P -> (examples, P)."""
        i = rng.randrange(len(self.examples))
        lp, la = int(self.lp[i]), int(self.la[i])
        r = rng.random()
        if r < boundary_share and la > block:  # the second block of a long answer
            pos = lp + block
            fits = (self.lp == lp) & (self.la > block)
        elif r < 0.5:  # block at the answer start: same prompt length
            pos = lp
            fits = self.lp == lp
        else:  # block somewhere inside the answers
            pos = lp + rng.randrange(la)
            fits = (self.lp <= pos) & (pos < self.lp + self.la)
        return self._pick(rng, i, fits, n), pos


def tensors_for(batch: list[Example], pos: int, block: int, special: dict[str, int], gen):
    """-> ids [N, T], causal targets [N, T] (-100 = no loss), noisy blocks [2N, B], block targets [2N, B] (the
    block with a random mask, then with the complementary mask)."""
    import torch

    pad, mask = special["<|endoftext|>"], special["<|mask|>"]
    seqs = [e.prompt + e.answer for e in batch]
    t = max(max(len(s) for s in seqs), pos + block)
    ids = torch.full((len(batch), t), pad, dtype=torch.long)
    tgt = torch.full((len(batch), t), -100, dtype=torch.long)
    for i, (e, s) in enumerate(zip(batch, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        lp = len(e.prompt)
        tgt[i, lp - 1:len(s) - 1] = torch.tensor(e.answer)  # logits at j predict token j+1
        for j in e.history_targets:
            tgt[i, j - 1] = s[j]
    clean = ids[:, pos:pos + block]
    rate = torch.rand(len(batch), 1, generator=gen)
    masked = torch.rand(len(batch), block, generator=gen) < rate
    masked[torch.arange(len(batch)), torch.randint(0, block, (len(batch),), generator=gen)] = True
    # complementary masks: a second copy of the block masks exactly the positions the first keeps, so every block
    # position is a target once per step (twice the block-mode signal for one more 32-token pass)
    masked = torch.cat([masked, ~masked])  # [2N, B]
    clean = torch.cat([clean, clean])
    noisy = torch.where(masked, torch.full_like(clean, mask), clean)
    btgt = torch.where(masked, clean, torch.full_like(clean, -100))
    return ids, tgt, noisy, btgt


def step_loss(model, batch, pos, block, special, gen):
    import torch.nn.functional as F
    import torch

    ids, tgt, noisy, btgt = tensors_for(batch, pos, block, special, gen)
    n = max(len(e.prompt) + len(e.answer) for e in batch)  # past it only block padding: no causal loss, not run
    logits_a, state = model.run(ids[:, :pos])
    logits_b, _ = model.run(ids[:, pos:n], state)
    logits = torch.cat([logits_a, logits_b], dim=1)
    causal = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, :n].reshape(-1), ignore_index=-100)
    n_seq = len(batch)
    blogits = torch.cat([model.run(noisy[:n_seq], state, block=True)[0],
                         model.run(noisy[n_seq:], state, block=True)[0]])  # both copies after the same prefix state
    diff = F.cross_entropy(blogits.reshape(-1, blogits.shape[-1]), btgt.reshape(-1), ignore_index=-100)
    return causal, diff


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------
def prepare(out: Path, seed: int, family: Family = BUNDLED):
    """Tokenizer, config and eval set of the task family in OUT (deterministic); -> (tokenizer, special ids,
    config)."""
    from tokenizers import Tokenizer

    from clover_gguf.testing.tokenizer import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer(out, corpus=family.corpus(), n_merges=family.n_merges, template=family.template(),
                              exact_split=family.exact_split)
    vocab_size = -(-(max(special.values()) + 1) // 64) * 64
    cfg = make_config(special, vocab_size)
    with open(out / "eval.jsonl", "w") as f:
        for row in family.eval_set():
            f.write(json.dumps(row) + "\n")
    return Tokenizer.from_file(str(out / "tokenizer.json")), special, cfg


def train(out: Path, steps: int, seed: int = 0, resume: bool = False, micro: int = 16, lr: float = 3e-3,
          save_every: int = 100, log_every: int = 20, stop_after: int | None = None,
          boundary_share: float = 0.2, pool: int = 100_000, reading: str = READING,
          init_from: Path | None = None, history_c: float | None = None, history_bias: float | None = None,
          log: bool = True, family: Family = BUNDLED) -> None:
    """reading: the block softmax's reading the model is trained under (metadata.READINGS; its config.json says
    it). init_from: start from that checkpoint's weights (one this script made: the same tokenizer and shape)
    instead of random ones, its block-softmax tensors drawn afresh, so that they carry nothing of the reading it
    was trained under. history_c, history_bias: their starting values (set_history). log: the loss lines.
    family: the tasks (BUNDLED, or tool_tasks.FAMILY)."""
    import torch

    tok, special, cfg = prepare(out, seed, family)
    cfg.extra[READING_FIELD] = check_reading(reading, "--reading")
    torch.manual_seed(seed)
    model = init_model(cfg, seed)
    if init_from is not None:
        start_from(model, Path(init_from))
    set_history(model, history_c, history_bias)
    model.reading = reading
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    start = 0
    state_path = out / "train_state.pt"
    if resume and state_path.is_file():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = st["step"]
        print(f"resumed at step {start}", file=sys.stderr)
    data = Data(tok, pool, seed, family)
    warm = 100

    def lr_at(s: int) -> float:
        if s < warm:
            return lr * (s + 1) / warm
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))

    t0 = time.time()
    acc = {"c": 0.0, "d": 0.0}
    end = steps if stop_after is None else min(steps, start + stop_after)
    with fast_path():  # parallel GDN / MoE forms while training (tests check them against the reference loop)
        for s in range(start, end):
            rng = random.Random(seed * 1_000_003 + s)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + s)
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
            opt.zero_grad(set_to_none=True)
            for _ in range(2):
                batch, pos = data.micro_batch(rng, micro, cfg.block_size, boundary_share)
                causal, diff = step_loss(model, batch, pos, cfg.block_size, special, gen)
                ((causal + diff) / 2).backward()
                acc["c"] += causal.item() / 2
                acc["d"] += diff.item() / 2
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if log and (s + 1) % log_every == 0:
                print(f"step {s + 1} causal {acc['c'] / log_every:.4f} block {acc['d'] / log_every:.4f} "
                      f"lr {lr_at(s):.2e} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
                acc = {"c": 0.0, "d": 0.0}
            if (s + 1) % save_every == 0 or s + 1 == end:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s + 1}, state_path)
                save_checkpoint(model, out)
    save_checkpoint(model, out)
    if log:
        print(f"trained {end - start} steps in {time.time() - t0:.0f}s", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------
def load_eval(model_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(model_dir) / "eval.jsonl").read_text().splitlines() if line.strip()]


def load_tiny(model_dir: Path = ASSET_DIR, dtype=None):
    """-> (CloverModel, tokenizers.Tokenizer, eval rows) of a checkpoint folder made by this script."""
    import torch
    from tokenizers import Tokenizer

    from clover_gguf.reference import CloverModel

    model_dir = Path(model_dir)
    model = CloverModel.from_pretrained(model_dir, dtype=dtype or torch.float32)
    return model, Tokenizer.from_file(str(model_dir / "tokenizer.json")), load_eval(model_dir)


def evaluate_rows(model, tok, rows: list[dict], mode: str = "ar", accept: str = "exact", threshold: float = 0.95,
                  max_new_tokens: int = 96, verbose: bool = False) -> dict:
    """Decode every row with clover_gguf.decoding on the reference model -> figures and per-row token lists.

    A row is correct when the decoded text, thinking removed, contains its answer.
    """
    from clover_gguf.decoding import generate_all
    from clover_gguf.reference import ReferenceBackend

    backend = ReferenceBackend(model)
    correct, gen_tokens, passes, drafted, accepted, outputs = 0, 0, 0, 0, 0, []
    kinds: dict[str, list[int]] = {}  # kind -> [correct, rows]
    for row in rows:
        ids = tok.encode(row_conversation(row).prompt_text()).ids
        out, stats = generate_all(backend, ids, mode=mode, max_new_tokens=max_new_tokens, threshold=threshold,
                                  accept=accept)
        text = strip_thinking(tok.decode(out, skip_special_tokens=True))
        ok = row["answer"] in text
        correct += ok
        k = kinds.setdefault(row_kind(row), [0, 0])
        k[0], k[1] = k[0] + ok, k[1] + 1
        gen_tokens += stats.generated_tokens
        passes += stats.forward_passes
        drafted += stats.drafted_tokens
        accepted += stats.accepted_tokens
        outputs.append(out)
        if verbose and not ok:
            print(f"MISS {row['prompt']!r}: want {row['answer']!r} got {text!r}", file=sys.stderr)
    return {"mode": mode, "n": len(rows), "accuracy": correct / max(1, len(rows)),
            "by_kind": {k: c / n for k, (c, n) in kinds.items()},
            "tokens_per_pass": gen_tokens / max(1, passes), "generated_tokens": gen_tokens, "forward_passes": passes,
            "acceptance_rate": accepted / drafted if drafted else None, "outputs": outputs}


def main(argv: list[str] | None = None, family: Family = BUNDLED) -> int:
    prog = "python -m clover_gguf.testing." + ("train_tiny" if family is BUNDLED else "tool_tasks")
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=3200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--micro", type=int, default=16, help="sequences per micro-batch (two per step)")
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--boundary-share", type=float, default=0.2,
                    help="share of micro-batches whose block starts 32 tokens into a long answer")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resume later)")
    ap.add_argument("--pool", type=int, default=100_000, help="training conversations drawn once from the seed")
    ap.add_argument("--reading", default=READING, choices=list(READINGS),
                    help="the block softmax's reading to train under (docs/architecture.md 3b)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this checkpoint's weights (its block-softmax tensors drawn afresh)")
    ap.add_argument("--history-c", type=float, default=None,
                    help="start every bd_softmax_history_c at this value (set_history: a model on which the "
                         "readings disagree)")
    ap.add_argument("--history-bias", type=float, default=None,
                    help="start every bd_softmax_history_bias at this value")
    ap.add_argument("--eval-only", action="store_true")
    ap.add_argument("--mode", default="ar", choices=["ar", "diffusion", "draft-self"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--accept", default="exact", choices=["exact", "threshold"])
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    # the parallel delta rule's decays e^{G_t - G_j} underflow over the tool family's hundreds of tokens: denormal
    # floats, which the CPU computes slowly, are flushed to zero (a difference far below float32's precision)
    torch.set_flush_denormal(True)
    if a.eval_only:
        if family is not BUNDLED:
            raise SystemExit("--eval-only reads the bundled tasks' rows: judge this family with bench/tiny_eval.py")
        model, tok, rows = load_tiny(a.out)
        t0 = time.time()
        r = evaluate_rows(model, tok, rows[:a.limit], a.mode, accept=a.accept, verbose=True)
        r.pop("outputs")
        print(json.dumps({**r, "seconds": round(time.time() - t0, 1)}))
        return 0
    train(a.out, a.steps, seed=a.seed, resume=a.resume, micro=a.micro, lr=a.lr, save_every=a.save_every,
          stop_after=a.stop_after, boundary_share=a.boundary_share, pool=a.pool, reading=a.reading,
          init_from=a.init_from, history_c=a.history_c, history_bias=a.history_bias, family=family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
