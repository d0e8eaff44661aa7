"""Offline tokenizers for the tiny test models and the shipped base models (no file or network access, deterministic).

- [`clip_tokenizer`]: CLIP BPE, the first merges of the BPE file bundled with `open_clip` (ids agree with real CLIP);
- [`t5_tokenizer`]: a hand-built T5 Unigram vocabulary (whole words, then single characters);
- [`qwen_tokenizer`]: a byte-level BPE trained in-process, wrapped in `Qwen2Tokenizer` with Qwen's special tokens and a
  ChatML template that renders image and video blocks as Qwen does;
- [`char_tokenizer`]: one token per character, for the masked-diffusion LM.
"""

from __future__ import annotations

import functools
import gzip
import json
from typing import Iterable


def _bpe_merges_used(word: str, ranks: dict[tuple[str, str], int]) -> set[tuple[str, str]]:
    """The merges that CLIP's BPE applies (lowest rank first) to turn `word` into its final tokens."""
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    used = set()
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == float("inf"):
            break
        used.add((parts[i], parts[i + 1]))
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return used


@functools.lru_cache(maxsize=1)
def _clip_bpe_merges() -> tuple[str, ...]:
    """All 48894 merges of open_clip's bundled CLIP BPE file, in rank order."""
    import open_clip.tokenizer

    with gzip.open(open_clip.tokenizer.default_bpe()) as f:
        lines = f.read().decode("utf-8").split("\n")
    return tuple(lines[1 : 49152 - 256 - 2 + 1])


def clip_tokenizer(n_merges: int = 486, model_max_length: int = 16, extra_words: Iterable[str] = ()):
    """Builds a CLIP BPE tokenizer in memory from the BPE file bundled with `open_clip`.

    Keeping only the first `n_merges` merges gives a small vocabulary of ``512 + n_merges + 2`` tokens (1000 by
    default) whose ids agree with the real CLIP tokenizer for the kept tokens. No file or network access.
    With `extra_words`, the merges that full CLIP applies to those (lower-case ASCII) words are kept as well, so
    each of them tokenizes exactly as in full CLIP (usually as a single token); their ids come after the first
    `n_merges` merges.

    Args:
        n_merges (`int`, defaults to 486): number of BPE merges kept (at most 48894).
        model_max_length (`int`, defaults to 16): padded/truncated length of the token sequences.
        extra_words (`Iterable[str]`, *optional*): words whose full-CLIP tokenization must be preserved.

    Returns:
        `transformers.CLIPTokenizer`: with ``<|startoftext|>`` as bos and ``<|endoftext|>`` as eos and pad.
    """
    import open_clip.tokenizer
    from transformers import CLIPTokenizer

    all_merges = _clip_bpe_merges()
    merges = list(all_merges[:n_merges])
    extra_words = sorted(set(extra_words))
    if extra_words:
        ranks = {tuple(m.split()): i for i, m in enumerate(all_merges)}
        used = set().union(*(_bpe_merges_used(w, ranks) for w in extra_words))
        merges += [m for m in all_merges[n_merges:] if tuple(m.split()) in used]  # keeps the rank order
    byte_vocab = list(open_clip.tokenizer.bytes_to_unicode().values())
    vocab = byte_vocab + [v + "</w>" for v in byte_vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={token: i for i, token in enumerate(vocab)},
        merges=[tuple(m.split()) for m in merges],
        model_max_length=model_max_length,
    )


# Words the hand-built T5 vocabulary keeps whole (everything else falls back to single characters).
T5_WORDS: tuple[str, ...] = (
    "a", "an", "the", "of", "and", "with", "in", "on", "photo", "picture", "image", "cat", "dog", "red", "green",
    "blue", "yellow", "cyan", "magenta", "circle", "circles", "square", "squares", "triangle", "triangles", "one",
    "two", "three", "four", "left", "right", "above", "below",
)
_T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"-()"


def t5_tokenizer(words: Iterable[str] = T5_WORDS, model_max_length: int = 16):
    """Builds a small T5 (Unigram) tokenizer in memory, deterministically and without any file or network access.

    The vocabulary is ``<pad>`` (0), ``</s>`` (1), ``<unk>`` (2), then each of `words` as a whole piece (``▁word``),
    the bare word boundary ``▁`` and single ASCII characters, so any ASCII prompt tokenizes (unknown words letter by
    letter). Trained Unigram vocabularies are not reproducible from run to run; this one is.

    Args:
        words (`Iterable[str]`, *optional*): words kept as single tokens (order-insensitive).
        model_max_length (`int`, defaults to 16): default padded/truncated length.

    Returns:
        `transformers.T5Tokenizer`: with ``<pad>`` as pad and ``</s>`` as eos; no ``<extra_id_*>`` tokens.
    """
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, -1.0) for w in sorted(set(words))]
    pieces += [("\u2581", -3.0)] + [(c, -5.0) for c in _T5_CHARACTERS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=model_max_length)


QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]
# Qwen's chat template, reduced to what the adapter uses: system / user / assistant turns whose content is a string or
# a list of {"type": "text" | "image" | "video"} blocks.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_CORPUS = (
    "You are a helpful assistant. How many red circles are in the image? What colour is the square? Give the box of "
    "the triangle. <think> I see two red circles and one blue square. </think> <answer> 2 </answer> "
    "<answer> [12, 30, 48, 60] </answer> red green blue yellow purple orange circle square triangle 0 1 2 3 4 5 6 7 8 9"
)


def qwen_tokenizer(corpus: str = QWEN_CORPUS, vocab_size: int = 400, extra_words: Iterable[str] = ()):
    """A byte-level BPE `Qwen2Tokenizer` trained on `corpus` (deterministic), with Qwen's special tokens.

    Args:
        corpus (`str`, defaults to `QWEN_CORPUS`): text the BPE merges are learnt from.
        vocab_size (`int`, defaults to 400): BPE vocabulary size before the special tokens.
        extra_words (`Iterable[str]`, *optional*): more training text, appended to `corpus`.

    Returns:
        `transformers.Qwen2Tokenizer`: ``<|im_end|>`` as eos, ``<|endoftext|>`` as pad, with the ChatML template.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    bpe.train_from_iterator([corpus, *extra_words] * 4, trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    tok = Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


CHAR_SPECIALS = ["<pad>", "<bos>", "<eos>", "<mask>"]
CHAR_CHARACTERS = list("0123456789+-*=?:() ")


def char_tokenizer(characters: list[str] | None = None):
    """A character-level fast tokenizer: one token per character of `characters` (defaults to `CHAR_CHARACTERS`),
    plus ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2) and ``<mask>`` (3); unknown characters are dropped."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(CHAR_SPECIALS + (characters or CHAR_CHARACTERS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", mask_token="<mask>",
        unk_token="<pad>", clean_up_tokenization_spaces=False,
    )
