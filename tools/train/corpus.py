"""The tiny embedded models' shared training pieces: the story corpus, the tokenizer, batching and the loop.

Used by ``tools.train.tiny_v4`` (DeepSeek-V4, trained through transformers) and ``tools.train.tiny_v41``
(DeepSeek-V4.1, trained through the dense reference ``tools.train.v41_dense``): both models read the same
generated stories and train with the same schedule, so they differ only in their architecture.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

# On a shared 2-core machine, spinning OpenMP workers starve each other (3x slower); must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after OMP_WAIT_POLICY is set (see above)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402 - as torch
from transformers import PreTrainedTokenizerFast  # noqa: E402 - as torch

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"  # ids 0, 1, 2 as in DeepSeek

# --------------------------------------------------------------------------------------------------
# Corpus: a small grammar of children's stories.  Characters keep their name and pronoun through a
# story, so the model has something to carry across sentences (and across the sliding window).
# --------------------------------------------------------------------------------------------------

GIRLS = ["Lily", "Mia", "Anna", "Sara", "Lucy", "Emma", "Zoe", "Ella", "Rose", "Amy", "Kate", "Nora", "Ivy", "Ruby",
         "Maya", "Grace"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Ollie", "Jake", "Dan", "Oscar", "Eli",
        "Hugo", "Luke"]
KINDS = {  # kind -> pronoun
    "girl": "she", "boy": "he", "dog": "he", "cat": "she", "bunny": "she", "bear": "he",
    "bird": "she", "fox": "he", "duck": "she", "mouse": "he", "frog": "he", "pig": "she", "owl": "she",
    "lion": "he", "goat": "he", "sheep": "she", "turtle": "he", "squirrel": "she",
}
SIZES = ["little", "small", "big", "tiny", "young"]
TRAITS = ["happy", "kind", "brave", "curious", "shy", "funny", "clever", "gentle", "busy", "sleepy", "silly", "quiet",
          "strong", "polite"]
HOMES = ["in a small house", "near the woods", "by the sea", "on a big farm", "in a quiet town",
         "next to a river", "on a green hill", "in the city"]
LIKES = ["play in the park", "draw pictures", "sing songs", "read books", "run in the grass",
         "look at the stars", "help her mom", "bake cakes", "swim in the lake", "climb trees",
         "pick flowers", "play with blocks", "ride a bike", "jump in the puddles", "dance in the kitchen",
         "build sand castles", "watch the birds", "play the drum"]
PLACES = ["park", "forest", "beach", "garden", "market", "school", "zoo", "lake", "farm", "library", "river", "hill",
          "bakery", "playground", "pond"]
COLORS = ["red", "blue", "green", "yellow", "shiny", "soft", "old", "pretty", "big", "little", "purple", "orange",
          "golden", "striped"]
THINGS = ["ball", "box", "hat", "kite", "book", "shell", "key", "cup", "stone", "toy car", "flower",
          "feather", "map", "bell", "spoon", "sock", "blanket", "drum", "balloon", "ring", "basket", "lamp",
          "puzzle", "boat"]
SPOTS = ["under a tree", "behind a rock", "near the pond", "in the sand", "on the path",
         "under the bed", "in the grass", "by the fence", "next to a bench", "inside a box", "at the top of the hill",
         "under a leaf"]
FEELINGS_GOOD = ["happy", "excited", "glad", "proud", "surprised"]
FEELINGS_BAD = ["sad", "scared", "worried", "upset", "tired"]
PROBLEMS = [("it was stuck in a tree", "used a long stick to get it down"),
            ("it was very dirty", "washed it with soap and water"),
            ("it was broken", "fixed it with some tape"),
            ("it was too heavy to carry", "pushed it all the way home"),
            ("it fell into the water", "pulled it out with a net"),
            ("the wind blew it away", "ran after it until they caught it")]
WEATHER = ["The sun was warm.", "The sky was blue.", "It was a rainy day.", "The wind was cold.",
           "It was a sunny morning.", "The clouds were gray."]
FOODS = ["apples", "cookies", "bread", "soup", "cake", "carrots", "berries", "pie", "pancakes", "honey", "grapes",
         "cheese", "muffins"]
SAYINGS_GOOD = ["Look what I found!", "This is the best day ever!", "Thank you so much!",
                "I love it!", "Wow, how pretty!", "Can we play again tomorrow?"]
SAYINGS_HELP = ["Can you help me?", "Can you help me, please?", "What should I do?", "Will you help me?"]
ENDINGS = ["They played together until the sun went down.", "They ate {food} and laughed.",
           "They went home and had a nice dinner.", "That night, {name} slept with a big smile.",
           "They became best friends.", "They shared the {thing} and had fun all day."]
MORALS = ["From that day on, {name} always helped {pos} friends.",
          "{Name} learned that it is good to share.", "{Name} learned to be brave.",
          "{Name} knew that friends make everything better.", ""]


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class StoryGenerator:
    """Draws one short story from the grammar above; all randomness comes from one `random.Random`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def character(self, exclude: str = "") -> tuple[str, str, str]:
        """(name, kind, pronoun); people get human names, animals get either."""
        kind = self.rng.choice(list(KINDS))
        pron = KINDS[kind]
        pool = GIRLS if pron == "she" else BOYS
        name = self.rng.choice([n for n in pool if n != exclude])
        return name, kind, pron

    def story(self, hero: tuple[str, str, str] | None = None) -> str:
        """A story about ``hero`` ((name, kind, pronoun); default: a new character)."""
        pick = self.rng.choice
        name, kind, pron = hero or self.character()
        friend, fkind, _ = self.character(exclude=name)
        pos = "her" if pron == "she" else "his"
        Pron = pron.capitalize()
        size, trait = pick(SIZES), pick(TRAITS)
        like = pick(LIKES).replace("her mom", f"{pos} mom")
        color, thing, spot, place = pick(COLORS), pick(THINGS), pick(SPOTS), pick(PLACES)
        s: list[str] = []

        parent = pick(["mom", "dad"])
        found = f"{article(color)} {color} {thing} {spot}"
        if self.rng.random() < 0.15:  # open on an outing, then introduce the character
            s.append(pick(WEATHER))
            s.append(f"{name} and {pos} {parent} went to the {place}.")
            s.append(f"{name} was {article(size)} {size} {kind}.")
            s.append(f"There, {pron} found {found}.")
        else:
            s.append(pick([
                f"Once upon a time, there was {article(size)} {size} {kind} named {name}.",
                f"There once was {article(trait)} {trait} {kind} called {name}.",
                f"{name} was {article(size)} {size} {kind} who lived {pick(HOMES)}.",
                f"Once upon a time, {article(trait)} {trait} {kind} named {name} lived {pick(HOMES)}.",
                f"{article(size).capitalize()} {size} {kind} named {name} lived {pick(HOMES)}.",
            ]))
            s.append(pick([f"{Pron} liked to {like}.", f"{Pron} loved to {like}.",
                           f"Every day, {name} liked to {like}.", f"{Pron} was very {trait}."]))
            if self.rng.random() < 0.4:
                s.append(pick(WEATHER))
            event = self.rng.random()
            if event < 0.5:  # finds something
                s.append(pick([f"One day, {name} went to the {place} and found {found}.",
                               f"One day, {pron} found {found}.", f"One morning, {name} saw {found}."]))
            elif event < 0.75:  # has something and takes it out
                s.append(f"{name} had {article(color)} {color} {thing}.")
                s.append(pick([f"{Pron} played with it every day.", f"It was {pos} favorite toy.",
                               f"{Pron} took it everywhere."]))
                s.append(f"One day, {pron} took the {thing} to the {place}.")
            else:  # goes out with a parent and finds something
                s.append(f"One day, {name} and {pos} {parent} went to the {place}.")
                s.append(f"There, {pron} found {found}.")
        s.append(pick([f"{Pron} was very {pick(FEELINGS_GOOD)}.", f"\"{pick(SAYINGS_GOOD)}\" said {name}.",
                       f"{name} picked up the {thing} and smiled."]))

        if self.rng.random() < 0.7:  # a problem, a friend, a fix
            problem, fix = pick(PROBLEMS)
            s.append(f"But {problem}.")
            s.append(f"{name} felt {pick(FEELINGS_BAD)}.")
            s.append(pick([f"Then {pron} saw {pos} friend {friend}, the {fkind}.",
                           f"Just then, {article(fkind)} {fkind} named {friend} came by."]))
            s.append(f"\"{pick(SAYINGS_HELP)}\" asked {name}.")
            s.append(pick([f"\"Yes, I can help you,\" said {friend}.", f"{friend} said, \"Do not worry. I will help.\"",
                           f"{friend} nodded and smiled."]))
            s.append(f"Together, they {fix}.")
            s.append(f"{name} was {pick(FEELINGS_GOOD)} again.")
        else:  # a friend comes to play
            s.append(pick([f"{name} took the {thing} to the {place} to show {pos} friend {friend}.",
                           f"Then {pron} ran to show the {thing} to {friend}, the {fkind}."]))
            s.append(f"\"What a {color} {thing}!\" said {friend}.")

        s.append(pick(ENDINGS).format(name=name, food=pick(FOODS), thing=thing))
        moral = pick(MORALS).format(name=name, Name=name, pos=pos)
        if moral:
            s.append(moral)
        if self.rng.random() < 0.3:
            s.append("The end.")
        return " ".join(s)


def build_corpus(n_stories: int, seed: int) -> list[str]:
    gen = StoryGenerator(random.Random(seed))
    return [gen.story() for _ in range(n_stories)]


# --------------------------------------------------------------------------------------------------
# Chats: a user asks for a story (often naming its hero), the assistant tells it with thinking off.
# --------------------------------------------------------------------------------------------------

REQUESTS = ["Tell me a story.", "Tell me a story about a {kind}.", "Tell me a story about a {kind} named {name}.",
            "Write a short story about {name} the {kind}.", "Can you tell me a story about {name}?",
            "Please tell me a bedtime story about a {kind}.", "I want a story about a {kind} called {name}.",
            "Tell a story.", "Tell me a story about {name}."]
AGAIN = ["Tell me another story.", "Another one, please.", "Now tell me a story about a {kind}.",
         "Tell me one more story about {name}."]
SYSTEMS = ["You tell short stories for children.", "You are a helpful assistant.", "Answer with a story."]


def build_chats(n_chats: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations (OpenAI messages) ending with the assistant's story: 15% open with a system prompt, 15% ask
    for a second story after the first."""
    rng = random.Random(seed)
    gen = StoryGenerator(rng)
    chats = []
    for _ in range(n_chats):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.15 else []
        for turn in range(2 if rng.random() < 0.15 else 1):
            hero = gen.character()
            ask = rng.choice(AGAIN if turn else REQUESTS).format(name=hero[0], kind=hero[1])
            messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": gen.story(hero)}]
        chats.append(messages)
    return chats


def render_chats(chats: list[list[dict[str, str]]]) -> list[str]:
    """Each conversation in the DeepSeek-V4.1 format (DeepInfer's renderer, thinking off), without the BOS that
    the tokenizer adds: ``<｜User｜>ask<｜Assistant｜></think>story<｜end▁of▁sentence｜>``."""
    from deepinfer.chat.deepseek_v41 import encode

    return [encode(chat, thinking=False, add_bos=False) for chat in chats]



# --------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE, bos prepended by the post-processor (as DeepSeek's tokenizer does).
# --------------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int, extra_special: tuple[str, ...] = (),
                    chat_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """``extra_special`` tokens (never produced by the corpus) take the ids right after bos, eos and pad, then
    ``chat_tokens``: whole tokens that are not special (decoding keeps them, as the released tokenizer's
    ``<｜User｜>``, ``<think>``, ``｜DSML｜`` ...)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD, *extra_special, *chat_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if chat_tokens:  # reserved like special tokens (ids, never merged), then marked as ordinary added tokens
        data = json.loads(tok.to_str())
        for added in data["added_tokens"]:
            added["special"] = added["content"] not in chat_tokens
        tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    extra = {"additional_special_tokens": list(extra_special)} if extra_special else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 20, **extra
    )


# --------------------------------------------------------------------------------------------------
# Training: stories packed into fixed-length rows (bos story eos bos story eos ...), AdamW, cosine LR.
# --------------------------------------------------------------------------------------------------


def add_training_args(parser: argparse.ArgumentParser, out: str, steps: int = 1000, batch: int = 8) -> None:
    """The flags both training tools take (defaults: the shipped assets' runs)."""
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--stories", type=int, default=40000)
    parser.add_argument("--vocab", type=int, default=2048, help="upper bound; BPE stops at whole words")
    parser.add_argument("--threads", type=int, default=2)


def pack(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int) -> torch.Tensor:
    """[rows, seq_len] int64; rows are longer than the largest compress ratio, so compressed entries appear."""
    stream: list[int] = []
    for ids in tokenizer(texts).input_ids:  # each starts with bos
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


LossFn = Callable[[torch.Tensor], torch.Tensor]  # a batch of rows [B, S] -> the scalar training loss


@torch.no_grad()
def eval_loss(model: torch.nn.Module, loss_fn: LossFn, rows: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [loss_fn(rows[i : i + batch]).item() for i in range(0, len(rows), batch)]
    model.train()
    return sum(losses) / len(losses)


def train(model: torch.nn.Module, loss_fn: LossFn, rows: torch.Tensor, held_out: torch.Tensor,
          args: argparse.Namespace, eval_fn: LossFn | None = None) -> float:
    """AdamW with warm-up and cosine decay on random rows; returns the mean training loss over the last 50 steps.

    ``eval_fn`` (default ``loss_fn``) gives the held-out loss: the plain LM loss when ``loss_fn`` adds aux terms."""
    # Weight decay on matrices, except the mHC mixing weights (hc_attn_fn, hc_ffn_fn, ...), which set stream gains.
    is_mhc = {n: "hc" in n.split(".")[-1] or "hc" in n.split(".")[-2] for n, _ in model.named_parameters()}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not is_mhc[n]]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or is_mhc[n]]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    recent: list[float] = []
    start = time.time()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=min(50, args.steps // 10 + 1))
        loss = loss_fn(rows[torch.randint(len(rows), (args.batch,), generator=gen)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-50:]
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  avg50 {sum(recent) / len(recent):.3f}  "
                  f"{time.time() - start:6.0f}s", flush=True)
    print(f"held-out loss {eval_loss(model, eval_fn or loss_fn, held_out, args.batch):.3f}")
    return sum(recent) / len(recent)


PROMPTS = ["Once upon a time, there was a", "One day, Lily went to the", "Tom was a little dog who",
           "Tom had a big red ball.", "The sun was warm. Mia and her mom went to the park."]
