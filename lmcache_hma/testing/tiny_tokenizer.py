"""The tiny models' tokenizer: byte-level BPE trained on a small built-in corpus (deterministic)."""

from __future__ import annotations

PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<bos>", "<unk>"
# Same ids as the real Gemma tokenizers: pad=0, eos=1, bos=2 (unk=3).
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN]
TOKENIZER_VOCAB_SIZE = 1024


# Small built-in English corpus; BPE training on it is deterministic. It must
# contain the words of the prompts used in tests often enough that each of
# them becomes a single token (e.g. "Hello, how are you?" -> 6 tokens).
_CORPUS = """\
Hello, how are you? I am fine, thank you. And how are you today?
Hello, my name is Alice. Hello, my name is Bob. What is your name?
Tell me a very long story about a dragon who lived in the mountains.
Tell me a story. Tell me a long story. Tell me a very long story, please.
Once upon a time there was a little girl who lived in a small house near the forest.
Every morning she walked to the river to fetch water for her mother and her brother.
The quick brown fox jumps over the lazy dog. The dog did not move at all.
It was a dark and stormy night, and the wind was blowing through the old trees.
The king and the queen had three children: two sons and one daughter.
They lived happily ever after, and the people of the kingdom loved them.
What time is it? It is half past seven in the evening, and dinner is ready.
Where do you live? I live in a big city with many people, cars and shops.
Can you help me with my homework? Of course, I would be happy to help you.
The weather is nice today. The sun is shining and the birds are singing.
She said that she would come back tomorrow, but she never came back again.
We went to the market to buy some bread, some cheese, some fruit and some milk.
He opened the door slowly and looked into the room, but nobody was there.
This is a test of the tokenizer. This is only a test, nothing more than that.
Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text from time to time.
Good morning! Good afternoon! Good evening! Good night, and sleep well.
Why is the sky blue? Because the air scatters blue light more than red light.
I think that this is a very good idea, and I hope that it will work for us.
The cat sat on the mat, and the mouse ran under the table to hide from it.
Please write a short poem about the sea, the moon and the stars at night.
My favourite colour is green, but my sister likes red and my brother likes blue.
The computer program reads the input, computes the answer, and prints the result.
A long time ago, in a land far away, there lived an old man and his wife.
They had no children, and they were very sad, so they asked the wizard for help.
"""


def _corpus_lines() -> list[str]:
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    # Repeat the test prompts so their words surely become whole tokens.
    must = ["Hello, how are you?", "Tell me a very long story", "Hello, my name is"]
    return lines * 3 + must * 20


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """Byte-level BPE tokenizer (GPT-2 style splitting) with a BOS post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=10**9,
        clean_up_tokenization_spaces=False,
    )
