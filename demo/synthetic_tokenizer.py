"""The synthetic model's tokenizer: byte-level BPE trained (seeded, offline) on a few
paragraphs of prose and code, with Llama-3-style special tokens and chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)

_TOKENIZER_TRAIN_VOCAB = 1531  # + 5 special tokens = 1536

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def write_tokenizer(out_dir: Path, *, model_max_length: int = 2048) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the
    vocab size including special tokens."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(out_dir / "tokenizer_config.json", config)
    write_json(
        out_dir / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN}
    )
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_TRAIN_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _training_texts() -> list[str]:
    prose = [" ".join(paragraph.split()) for paragraph in _PROSE.split("\n\n")]
    return prose + _CODE.split("\n\n")


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Special tokens are appended after the trained vocab, in SPECIAL_TOKENS order."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n")


# Prose paragraphs are wrapped here for reading and unwrapped for training.
_PROSE = """\
The morning train left the station a few minutes late, and the passengers settled into their seats
with coffee and newspapers. Outside the window, the fields were still grey with frost, and a thin
line of smoke rose from a farmhouse near the river. A child pressed her face to the glass and
counted the cows as they passed. Her father read the weather report aloud: cold in the morning,
clear skies in the afternoon, and a chance of rain by the evening.

A good cook keeps a clean kitchen and a sharp knife. Before you start, read the whole recipe and
gather what you need: flour, butter, eggs, sugar, a pinch of salt, and a little milk. Mix the dry
ingredients in one bowl and the wet ingredients in another, then fold them together gently. Do not
stir too much, or the bread will be tough. Bake it in a hot oven until the top is golden brown, and
let it cool on a rack before you cut it.

The library on the hill was built more than a hundred years ago. Its shelves hold books about
history, science, music, and the sea. Students come in the afternoon to study, and old men come in
the morning to read the papers and argue about politics. The librarian knows every reader by name.
She says that a library is not a room full of books but a place where people learn to ask better
questions.

When a server receives a request, it reads the prompt, turns the text into tokens, and runs the
model one step at a time. Each step produces a new token, and the server sends it back to the user
as soon as it is ready. A good scheduler keeps the machine busy by putting many requests into the
same batch. If memory runs low, the scheduler pauses the newest request and resumes it later, so
that the oldest requests finish first.

A small adapter can teach a large model a new skill without changing the model itself. The adapter
holds two thin matrices for each layer it touches. At run time the engine multiplies the input by
the first matrix, then by the second, and adds the result to the output of the original layer.
Because the adapters are small, one machine can keep hundreds of them in memory and switch between
them for every request in a batch.

The river runs from the mountains to the sea. In the spring it is fast and cold, full of melted
snow, and in the summer it is slow and warm, and children swim in the deep pools under the bridge.
Fishermen wait on the rocks at dawn. Herons stand in the shallow water, perfectly still, until a
fish comes close, and then they strike faster than the eye can follow.

My grandmother kept a garden behind her house. She grew tomatoes, beans, potatoes, onions, and tall
yellow flowers that turned to follow the sun. Every evening she walked along the rows with a
watering can and talked to the plants as if they were old friends. She said that a garden teaches
patience, because nothing you plant today will be ready tomorrow, and nothing good ever grows in a
hurry.

Questions and answers. What is the capital of France? The capital of France is Paris. How many days
are in a week? There are seven days in a week. What color is the sky on a clear day? The sky is
blue on a clear day. Why do leaves fall in autumn? The trees stop feeding their leaves when the
days get short and cold, so the leaves dry out and fall to the ground.

Dear team, thank you for your hard work this quarter. We shipped the new release on time, the error
rate is down, and our users are happier than they have ever been. Next month we will focus on speed
and on the documentation. Please send me your ideas before Friday, and let us meet on Monday
morning to plan the work. Best regards, and enjoy the weekend.

The history of numbers is the history of people trying to count the world. Shepherds cut marks in
sticks to count their sheep. Merchants wrote numbers on clay to keep track of grain and oil. Much
later, scholars learned to write zero, and with zero came the idea that a number could stand for
nothing at all. Today a computer counts billions of times every second, yet it still uses the same
simple ideas: one, two, many, and none.

Once upon a time there was a fox who wanted to learn to sing. He asked the birds to teach him, but
they laughed and flew away. He asked the wind, but the wind only whistled. At last he asked an old
owl, who said: listen first, and sing later. So the fox listened to the forest every night for a
year, and when spring came, he sang a song that made the whole forest fall silent.

The city wakes up slowly on Sunday. The shops open late, the streets are quiet, and the smell of
fresh bread drifts out of the bakery on the corner. People walk their dogs in the park, and a man
plays the violin near the fountain for a few coins. By noon the cafes are full, and friends sit
outside in the sun, talking about the week that has passed and the week that is coming.

Travel tips: pack light, carry a map, and learn a few words of the local language, such as hello,
please, thank you, and goodbye. Drink plenty of water, wear comfortable shoes, and keep a copy of
your passport in a safe place. Try the local food, talk to the people you meet, and do not plan
every hour of the day. The best moments of a journey are often the ones you did not expect.

The doctor listened to the patient's heart and lungs, checked his blood pressure, and asked him how
he had been sleeping. She told him to rest, to drink more water, and to take a short walk every
day. If the pain comes back, she said, call the clinic and we will see you again next week. He
thanked her, put on his coat, and walked out into the bright afternoon feeling better than he had
in days.

Mountains are made slowly. Over millions of years the plates of the earth push against each other,
and the rock folds and rises like a rug pushed against a wall. Rain and ice wear the peaks down
again, carrying sand and stones to the valleys and the sea. What looks solid and eternal is in fact
always moving, only so slowly that a human life is too short to see it.

In the evening the family gathered around the table. There was soup, bread, cheese, and a bowl of
apples from the tree in the yard. The youngest son told a story about his day at school, and
everyone laughed. Later, when the dishes were washed and the lights were low, their mother read a
chapter from an old book, and one by one the children fell asleep.
"""

_CODE = """\
def add(a, b):
    return a + b

def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

{"name": "demo", "version": "1.0.0", "tags": ["small", "offline"], "enabled": true, "limit": 42}
{"user": "alice", "role": "admin", "email": "alice@example.com", "last_login": "2024-05-01"}
{"request_id": 1234, "prompt": "Write a poem about the sea.", "max_tokens": 64, "top_p": 0.9}

SELECT name, email FROM users WHERE active = 1 ORDER BY name LIMIT 10;
SELECT count(*) AS total FROM orders WHERE created_at > '2024-01-01' GROUP BY customer_id;
"""
