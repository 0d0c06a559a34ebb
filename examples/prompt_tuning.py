"""Deep prompt tuning of SmolLM2 through a local 3-server swarm: sentiment of short reviews.

The model's blocks stay frozen on the servers; the client trains a prefix of input embeddings and a
prompt per block (tuning_mode="deep_ptune"), sending them with every forward and backward request.
The task is made up here: short reviews built from templates, to be classed " A" (positive) or " B"
(negative). The label words carry no meaning, so the untrained model is at chance (SmolLM2 already knows
" positive" from " negative" perfectly, which would leave nothing to learn). Test reviews use subjects
the training set never shows. The model's scores of the two label tokens after "Class:" are the
classifier: training minimises their cross-entropy (the gradient flows back through every server), and
accuracy compares them, before and after training (the question names the code, but the untrained model
still guesses).

    python examples/prompt_tuning.py [--steps 40] [--batch 16] [--lr 0.02] [--seed 0] [--initial-peers ADDR]

Without --initial-peers it starts its own swarm on 127.0.0.1 (1 DHT peer + 3 servers) and stops it at
the end. It prints the loss at every step and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from contextlib import ExitStack

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

from corolla.client.model import DistributedModelForCausalLM
from corolla.config import ClientConfig, SwarmConfig
from corolla.launch.local import LocalSwarm, even_spans

POSITIVE = ["great", "wonderful", "excellent", "lovely", "fantastic", "delightful", "superb", "pleasant",
            "amazing", "brilliant", "charming", "perfect"]  # fmt: skip
NEGATIVE = ["terrible", "awful", "horrible", "dreadful", "boring", "disappointing", "poor", "unpleasant",
            "bad", "annoying", "mediocre", "painful"]  # fmt: skip
TRAIN_SUBJECTS = ["the food", "the movie", "the hotel", "the service", "the book", "the concert", "the staff",
                  "the room", "the game", "the trip"]  # fmt: skip
TEST_SUBJECTS = ["the coffee", "the show", "the flight", "the museum", "the album", "the class"]
TEMPLATES = ["{s} was {a}.", "I thought {s} was {a}.", "Honestly, {s} was {a}!", "{s} felt {a} to me.",
             "Overall {s} was {a}."]  # fmt: skip
LABELS = {1: " A", 0: " B"}
QUESTION = "Review: {}\nIs it positive (A) or negative (B)? Class:"


def make_examples(subjects: list[str], rng: random.Random, count: int) -> list[tuple[str, int]]:
    examples = []
    for _ in range(count):
        label = rng.randint(0, 1)
        adjective = rng.choice(POSITIVE if label else NEGATIVE)
        text = rng.choice(TEMPLATES).format(s=rng.choice(subjects), a=adjective)
        examples.append((text[0].upper() + text[1:], label))
    return examples


def encode(tokenizer, examples: list[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [N, T] (right-padded, ending in the label token), label positions [N], labels [N]."""
    rows = [tokenizer(QUESTION.format(text)).input_ids + tokenizer(LABELS[label]).input_ids
            for text, label in examples]  # fmt: skip
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id or 0)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    positions = torch.tensor([len(row) - 1 for row in rows])
    return ids, positions, torch.tensor([label for _, label in examples])


def label_scores(model, ids: torch.Tensor, positions: torch.Tensor, label_ids: list[int]) -> torch.Tensor:
    """[N, 2]: the model's logits of " B" and " A" where the label token is predicted (the position
    before it). Training maximises the right one's share of the two: the classifier's loss."""
    logits = model(ids).logits
    return logits[torch.arange(len(ids)), positions - 1][:, label_ids]


def balanced_batch(labels: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """Indices of `size` examples, half of each class: a batch's label mix does not swing the classifier's
    bias from step to step (with random batches, one seed in three never got past chance)."""
    order = torch.Generator().manual_seed(seed)
    halves = []
    for label in (0, 1):
        pool = (labels == label).nonzero().flatten()
        halves.append(pool[torch.randint(0, len(pool), (size // 2,), generator=order)])
    return torch.cat(halves)


@torch.no_grad()
def accuracy(model, data: tuple[torch.Tensor, ...], label_ids: list[int], batch: int) -> float:
    ids, positions, truth = data
    correct = 0
    for i in range(0, len(ids), batch):
        scores = label_scores(model, ids[i : i + batch], positions[i : i + batch], label_ids)
        correct += int((scores.argmax(dim=-1) == truth[i : i + batch]).sum())
    return correct / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--lr", type=float, default=0.02, help="Adam, falling linearly to 0 (default: %(default)s)"
    )
    parser.add_argument(
        "--prefix", type=int, default=8, help="trainable prompt length (default: %(default)s)"
    )
    parser.add_argument("--train-size", type=int, default=320)
    parser.add_argument("--test-size", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0, help="prompt init and batch order (default: 0)")
    parser.add_argument("--initial-peers", nargs="*", default=[])
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rng = random.Random(0)  # the same made-up data set for every seed
    train, test = (
        make_examples(TRAIN_SUBJECTS, rng, args.train_size),
        make_examples(TEST_SUBJECTS, rng, args.test_size),
    )

    with ExitStack() as stack:
        if args.initial_peers:
            peers = args.initial_peers
        else:
            print(
                "Starting a local swarm: 1 DHT peer + 3 SmolLM2 servers (blocks 0:10, 10:20, 20:30)",
                flush=True,
            )
            peers = stack.enter_context(LocalSwarm("smollm2", even_spans(30, 3))).initial_peers
        config = ClientConfig(
            swarm=SwarmConfig(initial_peers=tuple(peers), host="127.0.0.1", nat_port_map=False)
        )
        model = stack.enter_context(
            DistributedModelForCausalLM.from_pretrained(
                "smollm2", config=config, tuning_mode="deep_ptune", pre_seq_len=args.prefix
            )
        )
        tokenizer = model.tokenizer
        label_ids = [tokenizer(LABELS[0]).input_ids[0], tokenizer(LABELS[1]).input_ids[0]]
        train_ids, train_positions, train_truth = encode(tokenizer, train)
        test_data = encode(tokenizer, test)

        before = accuracy(model, test_data, label_ids, 32)
        print(f"Test accuracy before training: {before:.1%} ({len(test)} reviews about unseen subjects)")
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        # the learning rate falls linearly to 0: at a constant 0.02, one seed in three diverged late
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)
        losses, started = [], time.monotonic()
        progress = tqdm(range(args.steps), desc="deep prompt tuning")
        for step in progress:
            batch = balanced_batch(train_truth, args.batch, seed=args.seed * 100_003 + step)
            scores = label_scores(model, train_ids[batch], train_positions[batch], label_ids)
            loss = torch.nn.functional.cross_entropy(scores, train_truth[batch])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            decay.step()
            losses.append(round(loss.item(), 4))
            progress.set_postfix(loss=f"{loss.item():.3f}")
            tqdm.write(f"step {step + 1:3d}  loss {loss.item():.4f}")
        training_s = time.monotonic() - started
        after = accuracy(model, test_data, label_ids, 32)
        print(f"Test accuracy after training:  {after:.1%}")
    print(
        json.dumps(
            {
                "accuracy_before": before,
                "accuracy_after": after,
                "seed": args.seed,
                "lr": args.lr,
                "steps": args.steps,
                "batch": args.batch,
                "training_seconds": round(training_s, 1),
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main()
