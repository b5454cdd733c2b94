"""VLLMEngine's agentic path (common/rollout/episodes.py): turns of many episodes go to vLLM request by
request, as each episode becomes ready, so an episode waiting for its tool holds up no other's generation.

RequestTurns is a part of VLLMEngine (class VLLMEngine(RequestTurns, RolloutEngine)), kept in its own file:
it uses the engine's llm, replica, rollout_tp, eos_token_ids, lockstep_turns, and the state __init__ sets
(_turns, _turn_count: the requests in flight; _asleep, _weights_valid). Where turns must run in waves
(turns_in_waves) it hands over to RolloutEngine's add_turn / finished_turns, which call generate.
"""

import random

from common.rollout.engine import Sample


class RequestTurns:
    @property
    def turns_in_waves(self):
        """At rollout TP 1 turns go to vLLM request by request, as episodes become ready. The ranks of
        a TP > 1 replica each schedule alone and must add the same requests in the same order, which
        environment timing cannot promise: their turns run in waves (RolloutEngine's default)."""
        return self.rollout_tp > 1 or self.lockstep_turns

    def add_turn(self, key, prompt_ids, max_tokens, temperature, top_p, seed):
        if self.turns_in_waves:
            return super().add_turn(key, prompt_ids, max_tokens, temperature, top_p, seed)
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        assert not self._asleep and self._weights_valid, "add_turn before a weight sync or while asleep"
        # a new one per turn, sharing no list with the engine: vLLM's copy of it may then be shallow (skip_clone)
        params = SamplingParams(
            n=1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            seed=random.Random(f"{seed}/{self.replica}").getrandbits(48),
            logprobs=0,  # the sampled token's: every model token of an episode carries the engine's logprob
            flat_logprobs=True,
            detokenize=False,
            stop_token_ids=list(self.eos_token_ids),
            ignore_eos=not self.eos_token_ids,
            output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it is done
            skip_clone=True,
        )
        self._turn_count += 1
        request_id = f"turn-{self._turn_count}"
        prompt = list(map(int, prompt_ids))
        self._turns[request_id] = (key, prompt)
        # a token input as vLLM's renderer makes one ("type": "token"): no preprocessing of a raw prompt
        self.llm.llm_engine.add_request(request_id, {"type": "token", "prompt_token_ids": prompt}, params)

    def finished_turns(self):
        """One engine step (a batch of every running request's next token, new prompts prefilled):
        the turns it finished, maybe none."""
        if self.turns_in_waves:
            return super().finished_turns()
        done = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            key, prompt = self._turns.pop(out.request_id)
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            flat = completion.logprobs  # FlatLogprobs: the sampled token first at each position
            logprobs = [flat.logprobs[i] for i in flat.start_indices]
            assert [flat.token_ids[i] for i in flat.start_indices] == tokens, "logprobs do not follow the tokens"
            done.append((key, Sample(prompt, tokens, logprobs, completion.finish_reason)))
        return done
