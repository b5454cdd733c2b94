"""Worker for tests/test_reward_model.py: RewardModel.score against transformers' sequence
classifier on the same token ids, at the launch's TP (gloo, fp32).

    python tests/reward_model_worker.py RM_DIR OUT_JSON
    torchrun --nproc_per_node 2 tests/reward_model_worker.py RM_DIR OUT_JSON --tp 2
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PROMPTS = ["3=", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 7?"}], "1+1="]
RESPONSES = ["3", "seven, I think", "2, and some more text after it to make this row the longest"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rm_dir")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    import transformers

    from common.dist import destroy_distributed, init_distributed
    from common.reward_model import RewardModel

    info = init_distributed(tp=args.tp, seed=0)
    rm = RewardModel.load(args.rm_dir, tp=args.tp, micro_batch_size=2)  # 2 micro-batches of different lengths
    scores = rm.score(PROMPTS, RESPONSES, info.device)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(args.rm_dir).float().eval()
    with torch.no_grad():
        reference = [hf(torch.tensor([rm.token_ids(p, r)])).logits[0, 0].item() for p, r in zip(PROMPTS, RESPONSES)]
    if info.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"scores": scores.tolist(), "transformers": reference,
                       "templated": bool(rm.tokenizer.chat_template)}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
