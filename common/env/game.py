"""The built-in guessing game: find a hidden digit in a few turns, with feedback after each guess.

    python train_grpo.py --env game --max-turns 2 --steps 60   # the embedded tiny model, a few CPU minutes

An item is {"prompt": "guess", "answer": "7"} (GuessGame.make_items draws them, seeded, so the game
needs no --data). Each turn the model answers with a digit; the environment ends the episode with
reward 1 on the hidden digit, and otherwise answers with a user message:

    hint="reveal"     "no, NNNNNNNN" (the hidden digit, 8 times): the model learns to read its
                      observation. The embedded model (random init, 2 layers) finds a digit written 8
                      times beside its own one-digit guess far sooner than a single one, 13 tokens back
                      behind the chat template's turn header: reward 0.02 -> 0.59 over 60 steps with
                      --max-turns 2 (tests/test_agentic_learns.py), where a single digit stayed at the
                      blind level (0.15-0.2) for the 48 steps it was run
    hint="direction"  "higher" / "lower": a real search, for models that can already count

A miss is any turn that does not start with the hidden digit (with "direction", a turn without a
digit is told "a digit"); --max-turns bounds the game (reward 0 then). Guessing digits blindly
earns 0.1 + 0.9 x 0.1 = 0.19 over two turns; above that the model reads the feedback.
"""

import random

from common.env.base import Environment, Step


class GuessGame(Environment):
    hint = "reveal"

    @staticmethod
    def make_items(num_items, seed=0):
        rng = random.Random(seed)
        return [{"prompt": "guess", "answer": str(rng.randint(0, 9))} for _ in range(num_items)]

    def reset(self, item):
        self.answer = int(item["answer"])
        return [{"role": "user", "content": item["prompt"]}]

    def step(self, text):
        text = text.strip()
        guess = int(text[0]) if text[:1].isdigit() else None
        if guess == self.answer:
            return Step(done=True, reward=1.0)
        if self.hint == "reveal":
            feedback = f"no, {str(self.answer) * 8}"
        else:
            feedback = "a digit" if guess is None else "higher" if self.answer > guess else "lower"
        return Step(observation=[{"role": "user", "content": feedback}])


class DirectionGame(GuessGame):
    """The game with "higher" / "lower" feedback (--env game-direction)."""

    hint = "direction"
