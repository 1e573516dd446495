"""Build a tiny random-weight Llama and a byte-level BPE tokenizer, with no hub access.

Deterministic: the tokenizer is trained on a corpus generated here from a fixed word
list and a seeded PRNG (not on whatever files happen to be installed), and the
weights come from ``torch.manual_seed(0)``. Same torch + tokenizers versions give
the same files and the same greedy output.

Usage: python make_tiny_model.py OUT_DIR
"""

import pathlib
import random
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
WORDS = (
    "the a an of to in and or is are was be it that this for on with as by at from "
    "model engine sleep wake pause resume weight update request stream token tokens "
    "hello world user assistant system proxy server client health metrics state "
    "def class return import if else elif while for try except finally with yield "
    "async await lambda None True False self print value key list dict set tuple "
    "0 1 2 3 4 5 6 7 8 9 10 100 ( ) [ ] { } : ; , . = + - * / < > ! ? ' \" # _"
).split()


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        k = 3 + rng.randrange(12)
        lines.append(" ".join(WORDS[rng.randrange(len(WORDS))] for _ in range(k)))
    return lines


def main() -> None:
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.model_max_length = 16384
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=16384,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    print("saved", out, "vocab", len(fast), "params", sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main()
