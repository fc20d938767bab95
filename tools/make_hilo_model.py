"""Build the tiny model of the embedded multi-turn task (envs/hilo.py): tools/make_warm_start.py with hilo's settings,
so that RL starts from a policy that knows the game's format but not its winning strategy.

    python tools/make_hilo_model.py --overwrite          # rewrites assets/hilo-model/ (a few minutes on 2 CPU cores)
    python tools/make_hilo_model.py --out /tmp/hm --steps 300          # any make_warm_start.py option or override

assets/hilo-model is shipped as built elsewhere (docs/environments.md); a rebuild here wins fewer games (0.44 against
0.74 greedy on a 2-core CPU), so an existing model in --out is refused without --overwrite.

The player imitated is hilo's scripted_turn (envs/hilo.py), a sloppy one: it guesses each digit uniformly inside
the range the feedback so far leaves for it (a consistent but aimless player): it wins ~15% of 4-guess episodes,
while guessing the middle of each range wins all of them. The model imitates the player's guesses (the loss covers
the guesses and their end-of-turn token, never the prompt or the feedback) on episodes of training codes only
(envs/hilo.py's split); RL then has to find that the middle wins. The episodes follow configs/multiturn.yaml
(max_guesses=4, 4 turns).

Shape: Qwen2ForCausalLM, hidden 128, 4 heads of 32, MLP 512, 3 layers (two would have to find each digit's
range from every earlier guess and answer in one more hop), tied embeddings, vocab 17 (10 digits, < > = ?,
<pad>, <eos>, <unk>, in the order the shipped model has them), context 64 (a 4-guess episode of 3 digits is 26
tokens).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repo root
from tools import make_warm_start  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HILO = ["--out", "assets/hilo-model", "--config", os.path.join(ROOT, "configs", "multiturn.yaml"),
        "--chars", "0123456789<>=?", "--layers", "3", "--steps", "600", "--batch", "128", "--lr", "3e-3",
        "--n_eval", "100", "--threads", "1"]


def main(argv=None):
    """hilo's options first: any given on the command line come later and win."""
    return make_warm_start.main(HILO + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
