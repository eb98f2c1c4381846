"""The tiny reward models, built locally at launch like the tiny policy (nothing is downloaded).

``builtin:tiny-rm``: the tiny Qwen2 shape as a sequence classifier (one label), on the tiny tokenizer, trained (800
steps of 64 examples, under a minute on one core) to predict a rule's reward of a response from prompt + response
tokens: the learned reward of the end-to-end test, whose policy never sees the rule. The training responses are the prompt's right answer with each
position kept with a probability drawn per example, else a random word or, in half the examples, the word of
another prompt's answer there (sometimes cut short by EOS): every reward from 0 to 1 is seen, a random policy's
responses (~0.02) as well as a good one's, and the right answer to another prompt scores what the rule gives it
(without those, a model learnt that any repeated letter is right, and its policy wrote "f f f f" to every prompt).

``builtin:tiny-judge``: the tiny causal LM with head dim 64 (vLLM's CPU build can serve it), random: a generative
judge whose verdicts are noise but whose scores an offline call reproduces exactly.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

from hpcrl.tiny.model import build_tiny_model, build_tokenizer, quiet_progress_bars, tiny_config

Rule = Callable[[str, str], float]
"""``rule(response_text, answer) -> reward``: what the tiny reward model learns to predict."""


def training_batch(rng: random.Random, tokenizer, rows: Sequence[tuple[list[int], str, list[int]]],
                   response_length: int, rule: Rule, size: int) -> tuple[list[list[int]], list[float]]:
    """``size`` (prompt + response tokens, the rule's reward) examples of ``rows`` (prompt tokens, answer, answer
    tokens; module docstring)."""
    vocab = [i for i in range(len(tokenizer)) if i != tokenizer.pad_token_id]
    seqs, labels = [], []
    for _ in range(size):
        prompt_ids, answer, want = rows[rng.randrange(len(rows))]
        other = rows[rng.randrange(len(rows))][2] if rng.random() < 0.5 else None  # another prompt's answer
        keep = rng.random()
        response = [want[k] if k < len(want) and rng.random() < keep else
                    other[k] if other and k < len(other) else rng.choice(vocab) for k in range(response_length)]
        if rng.random() < 0.3:  # cut short by EOS, as a policy's response may be
            response = response[:rng.randrange(response_length)] + [tokenizer.eos_token_id]
        text = tokenizer.decode(response, skip_special_tokens=True)
        seqs.append(list(prompt_ids) + response)
        labels.append(float(rule(text, answer)))
    return seqs, labels


def build_tiny_rm(out_dir: Path | str, rows: Sequence[tuple[list[int], str]], response_length: int, rule: Rule,
                  seed: int = 0, steps: int = 800, batch: int = 64) -> Path:
    """Train the tiny sequence classifier on ``rows`` (``(prompt token ids, answer)``, the policy's prompts) to
    predict ``rule`` and write it with the tiny tokenizer to ``out_dir`` (an HF folder); returns it."""
    import torch

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = tiny_config(32, tokenizer)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.3M-parameter model: more threads only wait for each other (and the launcher's cores)
    try:
        return _train(out_dir, tokenizer, config, rows, response_length, rule, seed, steps, batch)
    finally:
        torch.set_num_threads(threads)


def _train(out_dir: Path, tokenizer, config, rows, response_length: int, rule: Rule, seed: int, steps: int,
           batch: int) -> Path:
    import torch
    from transformers import Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    rng = random.Random(seed)
    rows = [(list(p), a, list(tokenizer(a, add_special_tokens=False)["input_ids"])) for p, a in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        seqs, labels = training_batch(rng, tokenizer, rows, response_length, rule, batch)
        longest = max(len(s) for s in seqs)
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (longest - len(s)) for s in seqs])
        mask = (torch.arange(longest)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = hidden[torch.arange(len(seqs)), mask.sum(1) - 1]
        loss = torch.nn.functional.mse_loss(model.score(last)[:, 0], torch.tensor(labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    with quiet_progress_bars():
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def build_tiny_judge(out_dir: Path | str, seed: int = 0) -> Path:
    """The random tiny causal LM (head dim 64) as a generative judge, written to ``out_dir``."""
    return build_tiny_model(out_dir, seed=seed, head_dim=64)
