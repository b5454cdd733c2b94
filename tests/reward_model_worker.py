"""Worker for tests/test_reward_model.py: RewardModel.score against transformers' sequence
classifier on the same token ids, at each given layout in turn (gloo, fp32).

    python tests/reward_model_worker.py RM_DIR OUT_JSON
    torchrun --nproc_per_node 2 tests/reward_model_worker.py RM_DIR OUT_JSON --layouts tp2 cp2

Layouts: one (one rank), tp2 (TP=2), cp2 (CP=2: each text cut over the two CP ranks, its
score read on the rank that holds its last token). Several layouts reuse one launch: the
parallel groups are set up again for each (common.run.dist.init_distributed).
Writes {"scores": {layout: [N scores]}, "transformers": [N], "templated": bool,
"last_token_ranks": {layout: the CP rank holding each text's last token}} from rank 0.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPTS = ["3=", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 7?"}], "1+1="]
RESPONSES = ["3", "seven, I think", "2, and some more text after it to make this row the longest"]
LAYOUTS = {"one": dict(), "tp2": dict(tp=2), "cp2": dict(cp=2)}


def last_token_ranks(rm, cp):
    """The CP rank holding each text's last token, as RewardModel.score cuts the texts (2 texts
    per micro-batch, cut after the longer, B.context_parallel_slice): the test wants both."""
    from common.rl import batch as B

    lengths = torch.tensor([len(rm.token_ids(p, r)) for p, r in zip(PROMPTS, RESPONSES)])
    multiple = 8 * 2 * cp
    width = -(-int(lengths.max()) // multiple) * multiple
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    ranks = [None] * len(lengths)
    for mb in B.micro_batches(
        dict(mask=mask, row=torch.arange(len(lengths))), torch.arange(len(lengths)), 2, length_multiple=multiple
    ):
        for rank in range(cp):
            part = B.context_parallel_slice(dict(mb, tokens=mb["mask"]), cp, rank)
            for i, row in enumerate(mb["row"].tolist()):
                if (part["src_col"][i] == lengths[row] - 1).any():
                    ranks[row] = rank
    return ranks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rm_dir")
    ap.add_argument("out")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=["one"])
    args = ap.parse_args()
    import transformers

    from common.run.dist import destroy_distributed, init_distributed
    from common.train.reward_model import RewardModel

    scores, holders = {}, {}
    for name in args.layouts:
        layout = LAYOUTS[name]
        info = init_distributed(**layout, seed=0)
        rm = RewardModel.load(args.rm_dir, **layout, micro_batch_size=2)  # 2 micro-batches of different lengths
        scores[name] = rm.score(PROMPTS, RESPONSES, info.device).tolist()
        if layout.get("cp", 1) > 1:
            holders[name] = last_token_ranks(rm, layout["cp"])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(args.rm_dir).float().eval()
    with torch.no_grad():
        reference = [hf(torch.tensor([rm.token_ids(p, r)])).logits[0, 0].item() for p, r in zip(PROMPTS, RESPONSES)]
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "scores": scores,
                    "transformers": reference,
                    "templated": bool(rm.tokenizer.chat_template),
                    "last_token_ranks": holders,
                },
                f,
            )
    destroy_distributed()


if __name__ == "__main__":
    main()
