"""Token-in, token-out: the ids of an episode are the engine's own, and each observation is
tokenised once, as the chat template renders it after the model's turn.

An episode's ids are  prompt | turn 1 (sampled) | observation 1 | turn 2 (sampled) | ...  and the
engine is given exactly this concatenation before each turn. Re-rendering the whole conversation
with the chat template and tokenising it again would give other ids: the model's text need not
tokenise back to the ids it sampled, some templates are not append-only (Qwen3 drops the <think>
blocks of earlier turns, Llama 3 trims the content), and a turn separator after the end-of-turn
token is easily lost (verl#6921). So the model's ids are never re-tokenised; only the observation is:

    render  [user "u", assistant MARKER, *observation]  with the generation prompt, as text
    take    what follows MARKER: the template's end of the assistant turn, the observation, the
            next assistant header (Qwen3 without thinking: + its empty <think></think>)
    drop    the end-of-turn text the model already sampled (its stop token), when it did
    encode  the rest without adding special tokens

A turn the model did not end itself (cut at --max-new-tokens) keeps the template's end-of-turn
token in the observation: masked, but the engine and the trainer see it alike.
"""

MARKER = "<<MODEL_TURN_END_7F3A>>"  # assistant content no template alters (it is not trimmed or split)


class ChatCodec:
    """The chat template of `tokenizer` with the environment's tools and template options
    (e.g. Qwen3's enable_thinking=False), turning messages into the ids of an episode."""

    def __init__(self, tokenizer, tools=None, template_kwargs=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "--env renders prompts and observations with the tokenizer's chat template, and this tokenizer has "
                "none: use a chat (instruct) model, or give the tokenizer a chat_template"
            )
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        self._backend = _plain_backend(tokenizer)

    def render(self, messages, add_generation_prompt=True):
        """The chat template's text of `messages` (with the tools and template options)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text):
        """tokenizer.encode(text, add_special_tokens=False). For a fast tokenizer that keeps transformers' own encode,
        with its backend in the state that encode sets (no truncation, no padding, special tokens split as the
        tokenizer says), the backend's encode of the text: the same ids from the same call, without transformers'
        wrapping (half of an observation's tokenisation) and without the batch call, which lets go of the
        interpreter: the episode driver runs this on the engine's thread, which then waits to get it back."""
        backend = self._backend
        if (
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == bool(self.tokenizer.split_special_tokens)
        ):
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def turn_text(self, ids):
        """A model turn's text as the environment reads it: tokenizer.decode(ids, skip_special_tokens=True). A
        tokenizer's _decode is that without decode()'s per-id type check of the input (a fifth of the agentic
        driver's time in a CPU profile of 256 episodes; ids here are a list of ints)."""
        decode = getattr(self.tokenizer, "_decode", None) if isinstance(ids, list) else None
        return (decode or self.tokenizer.decode)(ids, skip_special_tokens=True)

    def prompt_ids(self, messages):
        """The first prompt's ids: the messages rendered, ending with the assistant header."""
        return self.encode(self.render(messages))

    def observation_text(self, messages, stop_text=None):
        """The text that follows the model's turn: the end of its turn (less `stop_text`, the
        decoded stop token the model sampled, when the template's end of turn starts with it), the
        observation `messages`, the next assistant header."""
        text = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": MARKER}, *messages])
        at = text.find(MARKER)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content as given")
        rest = text[at + len(MARKER) :]
        if stop_text and rest.startswith(stop_text):
            rest = rest[len(stop_text) :]
        return rest

    def observation_ids(self, messages, stop_id=None):
        """Ids of observation `messages` after a model turn that ended on `stop_id` (None: cut by a
        budget, the template's end-of-turn tokens are part of the observation)."""
        stop_text = None if stop_id is None else self.tokenizer.decode([stop_id])
        return self.encode(self.observation_text(messages, stop_text))


def _plain_backend(tokenizer):
    """The `tokenizers` backend of a fast tokenizer whose encode is transformers' TokenizersBackend's own (no
    subclass changes the text or the call on the way), else None."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.encode is PreTrainedTokenizerBase.encode
        and cls._encode_plus is TokenizersBackend._encode_plus
    ):
        return tokenizer._tokenizer
    return None
