"""Tiny models built in code: the embedded default of the command line (random weights, offline) and the models of
the tests. Each is a real transformers model of a supported family, with a small byte-level BPE tokenizer trained
here in a fraction of a second (Qwen's pre-tokenizer and chat format), so nothing is downloaded.
"""

from __future__ import annotations

import functools

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + (m['content'] if m['content'] is string else "
    "m['content']|map(attribute='text')|join) + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

# Qwen's pre-tokenizer split (the same family of regex as Llama 3 and GPT-4)
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_WORDS = ("the a an of to and in is was for on that with as it by at be this are from or have not but they his her "
          "which one all were we there their what so about when can said if out would who them up do will some time "
          "question answer option options letter level fits best only state team billing tech refund urgent tone "
          "calm annoyed furious needs reply within hour charged twice order please help support customer message "
          "passage article student school teacher story people water world because through between after before "
          "true false yes no maybe score choice decision kind user assistant system think").split()


def _corpus() -> list[str]:
    corpus = []
    for word in _WORDS:
        corpus += [word, word.capitalize(), f" {word}", f" {word.capitalize()}."]
    corpus += ["Yes", "No", " Yes", " No", "Answer Yes or No only.", "Answer with the letter of the option that fits "
               "best (A to D) only.", "\n\n", "\n", ": ", ". "] * 20
    return corpus


@functools.cache
def _tokenizer_json(kind: str) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = _corpus()
    if kind == "byte_level":  # Qwen's
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif kind == "gpt2":  # byte-level with GPT-2's own regex, where "\n " can be one pre-token
        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        corpus += ["\n  indented", "\n    return x", "end.\n  next"] * 20
    elif kind in ("sentencepiece", "llama2"):  # "\u2581" for spaces, no pre-tokenizer, byte fallback
        tk = Tokenizer(models.BPE(byte_fallback=True))
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
        alphabet = [chr(c) for c in range(32, 127)] + ["\u2581"]
        corpus += list("ABCDEFGHIJKLMNOPQRSTUVWXYZ") * 30
        if kind == "sentencepiece":  # merges over newlines ("d.\n", "\nThe"), as some SentencePiece vocabularies have
            alphabet.append("\n")
            corpus += ["end.\nNext line\nThe", "\nThe", ".\n\nThe", "\n  indented"] * 20
        else:  # Llama 2's: no piece holds a newline, which is always its byte token <0x0A>
            corpus = [line.replace("\n", " ") for line in corpus]
        special += [f"<0x{b:02X}>" for b in range(256)]
    else:
        raise ValueError(f"Unknown tiny tokenizer kind {kind!r}; kinds: byte_level, gpt2, sentencepiece, llama2.")
    trainer = trainers.BpeTrainer(vocab_size=1000 if kind in ("sentencepiece", "llama2") else 700, special_tokens=special,
                                  initial_alphabet=alphabet, show_progress=False)
    tk.train_from_iterator(corpus, trainer=trainer)
    return tk.to_str()


def tiny_tokenizer(kind: str = "byte_level"):
    """A small BPE tokenizer (700-1,000 tokens) in Qwen's chat format; labels A-Z, Yes, No are single tokens.
    `kind`: byte_level (Qwen's pre-tokenizer: the default), gpt2 (byte-level with GPT-2's regex), sentencepiece
    (SentencePiece style with pieces that cross newlines) or llama2 (SentencePiece style, newlines only as their byte
    token). Split tokenization is exact for byte_level and llama2; gpt2 and sentencepiece are the tests' tokenizers
    where a safe cut changes tokens (flide/split_check.py)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(kind)), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


# Tiny configs of each family: few layers, small widths, every layer type present
TINY_CONFIGS = {
    "qwen3_5_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4),
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=None),
}


def tiny_config(model_type: str, vocab_size: int, **overrides):
    from transformers import AutoConfig

    values = {**TINY_CONFIGS[model_type], "vocab_size": vocab_size, "tie_word_embeddings": False, **overrides}
    return AutoConfig.for_model(model_type, **values)


def tiny_model(model_type: str = "qwen3_5_text", vocab_size: int | None = None, seed: int = 0, **overrides):
    """A random tiny causal LM of `model_type` (float32, eval mode); vocab_size defaults to the tiny tokenizer's."""
    import torch
    from transformers import AutoModelForCausalLM

    if vocab_size is None:
        vocab_size = len(tiny_tokenizer()) + 2  # room for the decision sentinels transformers adds
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size, **overrides), dtype=torch.float32)
    return model.eval()


def tiny_jev(vocab_size: int | None = None, seed: int = 0, softcap: float | None = 30.0):
    """A random tiny JevForDecision on a tiny Qwen3.5 backbone."""
    import torch
    from transformers import JevConfig, JevForDecision

    if vocab_size is None:
        vocab_size = len(tiny_tokenizer()) + 2
    text = tiny_config("qwen3_5_text", vocab_size)
    torch.manual_seed(seed)
    model = JevForDecision(JevConfig(hidden_size=text.hidden_size, text_config=text.to_dict(), softcap=softcap))
    return model.float().eval()


def tiny_qwen3_5_multimodal(vocab_size: int | None = None, seed: int = 0):
    """A random tiny Qwen3_5ForConditionalGeneration (model_type `qwen3_5`): Flide runs its text model."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    if vocab_size is None:
        vocab_size = len(tiny_tokenizer()) + 2
    config = Qwen3_5Config(text_config={**TINY_CONFIGS["qwen3_5_text"], "vocab_size": vocab_size},
                           vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=64))
    torch.manual_seed(seed)
    return Qwen3_5ForConditionalGeneration(config).float().eval()
