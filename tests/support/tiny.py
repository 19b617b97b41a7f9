"""Tiny random-weight MLX models with a locally trained byte-level BPE tokenizer.

Everything here is deterministic and offline: the tokenizer is trained on a built-in corpus, the weights come from
mlx-lm's own model classes under a fixed seed, so two builds with the same arguments write identical bytes. The
folders load with ``mlx_lm.load`` and ``transformers.AutoTokenizer.from_pretrained`` like a converted checkpoint.

    path = tiny_model_cached(tmp_root, "qwen3_next")
    model, tokenizer = mlx_lm.load(str(path))
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
VOCAB_SIZE = 1000
ARCHS = ("llama", "qwen3", "qwen3_next")

# Bump when the builder's output changes, so that ``tiny_model_cached`` folders from an older build are not reused.
_BUILD_VERSION = 1

# Random init is rescaled so that greedy decoding does not fall into a one-token loop: a larger embedding keeps the
# residual stream far from zero, a larger output projection spreads the logits, and sharper attention (queries and
# keys scaled by _QK_SCALE) makes the next token depend on more than the current one. Feature 0 of every embedding
# is a constant that the output projection uses as a bias, to keep the tokens ``_vocab`` lists out of the output:
# their logits drop by about _SUPPRESS * _BIAS_FEATURE / (rms of the residual stream). End-of-sequence is damped
# the same way, less, so that generations reach max_tokens; a test that needs an end of sequence can force it with
# a logits processor.
_EMBED_STD = 1.0
_QK_SCALE = 3.0
_LM_HEAD_SCALE = 4.0
_BIAS_FEATURE = 2.0
_SUPPRESS = 16.0
_EOS_DAMPING = 4.0

_PROSE = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter. Every morning
they walked down to the harbour, checked the nets, and talked about the weather, the markets and the stars.
Science is a way of thinking much more than it is a body of knowledge. Water boils at 100 degrees Celsius at
sea level; at higher altitude it boils at a lower temperature because the air pressure is lower.
Hello, world! Hello! How are you today? I'm fine, thanks - and you? Let's meet at 10:30 on Monday, March 3rd, 2025.
The report (see section 4.2) lists three causes: cost, time, and risk. "Why?" she asked. 'Because,' he said.
Please summarise the following text in one sentence. Translate the sentence into French. Answer briefly.
You are a helpful assistant. The user asks a question and the assistant answers it clearly and politely.
What is the capital of France? The capital of France is Paris. What is 2 + 2? The answer is 4.
Machine learning models learn patterns from data. A language model predicts the next token in a sequence.
Large models are served by a daemon that batches requests, caches prefixes and streams tokens back to clients.
Rain fell softly on the roof while the kettle sang in the kitchen and the cat slept beside the warm stove.
In 1969, astronauts landed on the Moon; in 1989, the Berlin Wall fell; in 2008, markets crashed worldwide.
Email me at someone@example.com or visit https://example.org/docs?page=2&lang=en#install for details.
"""

_CODE = '''\
def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b
    return out


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()


if __name__ == "__main__":
    print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]

function add(a, b) { return a + b; }
const xs = [1, 2, 3].map((x) => x * 2);
for (int i = 0; i < n; ++i) { sum += v[i]; }
SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}
$ pip install mlx-lm && python -m mlx_lm.generate --prompt "hello" --max-tokens 32
# Title
- item one
- item two
| col a | col b |
|-------|-------|
| 1.5   | -2e-3 |
'''


def _corpus() -> list[str]:
    """The built-in training text, as lines; fixed, so the trained tokenizer is the same on every run."""
    lines = _PROSE.splitlines() + _CODE.splitlines()
    lines += [f"{a} + {b} = {a + b}; {a} * {b} = {a * b}." for a in range(3, 40, 7) for b in range(2, 30, 9)]
    lines += [" ".join(str(i) for i in range(start, start + 20)) for start in (0, 100, 1990)]
    lines.append(
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ 0123456789 ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz"
    )
    # Chat turns without their markup: special and added tokens are matched whole before BPE, so training on them
    # would only add fragments such as "<|" that a random model then writes.
    lines += ["system", "user", "assistant", "tool", *_CHAT_TURNS]
    return lines


_CHAT_TURNS = [
    "You are a helpful assistant.",
    "Write a haiku about autumn.",
    "A haiku has three lines.",
    "Leaves drift on cold wind,\nred and gold.",
    "What's the weather in Paris?",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>',
]

# Qwen2.5/Qwen3-style ChatML. Tool calls are rendered as JSON inside <tool_call> (mlx-lm infers "json_tools").
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": ' }}
    {{- '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + render_content(message.content) }}{%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


def build_tokenizer(out_dir: Path) -> None:
    """Train a byte-level BPE tokenizer (~1000 ids) on the built-in corpus and write it into ``out_dir``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML template, eos ``<|im_end|>``, pad
    ``<|endoftext|>``, no BOS). The output bytes are the same on every call.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _vocab(tokenizer_dir: Path) -> tuple[int, dict[str, int], list[int]]:
    """Vocabulary size, ids of the special and added tokens, and ids of the tokens random output should avoid.

    Those are the single-byte tokens that are not printable ASCII (a lone byte of a multi-byte UTF-8 character, a
    control character other than tab and newline) and the markup tokens other than end-of-sequence, so that a
    random model writes plain text that no reasoning or tool-call parser reacts to.
    """
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    suppressed = [ids[t] for t in ["<|im_start|>", *ADDED_TOKENS]]
    suppressed += [
        i
        for i in range(vocab_size)
        if any(not (ch.isascii() and (ch.isprintable() or ch in "\t\n")) for ch in tokenizer.decode([i]))
    ]
    return vocab_size, ids, sorted(suppressed)


def _model_config(arch: str, hidden_size: int, num_layers: int, vocab_size: int) -> dict[str, Any]:
    """A config.json for ``arch``: mlx-lm ``ModelArgs`` fields, small but shaped like the real checkpoints."""
    head_dim = 16
    config: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": max(1, hidden_size // (2 * head_dim)) * 2,
        "num_key_value_heads": max(1, hidden_size // (2 * head_dim)),
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if arch == "qwen3_next":
        config.update(
            # Layers alternate linear attention (ArraysCache) and full attention (KVCache).
            full_attention_interval=2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=32,  # Metal's gated-delta kernel needs a multiple of 32
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            mlp_only_layers=[],
            norm_topk_prob=True,
            partial_rotary_factor=0.25,
        )
    elif arch not in ARCHS:
        raise ValueError(f"unknown tiny model arch {arch!r}; known: {', '.join(ARCHS)}")
    return config


def _rescale(model: Any) -> Any:
    """A ``tree_map_with_path`` function: float32, with queries and keys scaled by ``_QK_SCALE``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    has_qk_norm = any(".q_norm." in path for path, _ in tree_flatten(model.parameters()))
    scaled = ("q_norm.weight", "k_norm.weight") if has_qk_norm else ("q_proj.weight", "k_proj.weight")

    def rescale(path: str, p: Any) -> Any:
        p = p.astype(mx.float32)
        return p * _QK_SCALE if path.endswith(scaled) else p

    return rescale


def _init_model(config: dict[str, Any], seed: int, suppressed: list[int], eos_ids: list[int]) -> Any:
    """Instantiate mlx-lm's model for ``config`` with seeded, rescaled float32 weights."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(tree_map_with_path(_rescale(model), model.parameters()))

    embed = model.model.embed_tokens
    weight = _EMBED_STD * mx.random.normal(embed.weight.shape, key=mx.random.key(seed))
    weight[:, 0] = _BIAS_FEATURE
    embed.weight = weight
    if not config["tie_word_embeddings"]:
        head = model.lm_head.weight * _LM_HEAD_SCALE
        suppress = mx.zeros((head.shape[0],))
        suppress[mx.array(suppressed, dtype=mx.int32)] = -_SUPPRESS
        suppress[mx.array(eos_ids, dtype=mx.int32)] = -_EOS_DAMPING
        head[:, 0] = suppress
        model.lm_head.weight = head
    mx.eval(model.parameters())
    return model


def build_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Build a random-weight mlx-lm model folder (config.json, model.safetensors, tokenizer) in ``out_dir``.

    ``arch`` is an mlx-lm model module (``llama``, ``qwen3``, ``qwen3_next``); ``overrides`` replace config.json
    fields (any ``ModelArgs`` field). Weights are float32 and depend only on the arguments. Returns ``out_dir``.
    """
    from mlx_lm.utils import save_config, save_model

    out_dir = Path(out_dir)
    build_tokenizer(out_dir)
    vocab_size, ids, suppressed = _vocab(out_dir)
    config = _model_config(arch, hidden_size, num_layers, vocab_size)
    config["eos_token_id"] = [ids[EOS_TOKEN], ids[PAD_TOKEN]]
    config["pad_token_id"] = ids[PAD_TOKEN]
    config.update(overrides)

    model = _init_model(config, seed, suppressed, config["eos_token_id"])
    save_model(out_dir, model)
    save_config(config, config_path=out_dir / "config.json")
    return out_dir


def _params_hash(arch: str, kw: dict[str, Any]) -> str:
    key = json.dumps({"arch": arch, "version": _BUILD_VERSION, **kw}, sort_keys=True, default=str)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def tiny_model_cached(root: Path, arch: str = "llama", **kw: Any) -> Path:
    """``build_tiny_model`` into ``root/<arch>-<hash of the arguments>`` once; later calls reuse the folder."""
    return build_once(Path(root) / f"{arch}-{_params_hash(arch, kw)}", lambda out: build_tiny_model(out, arch, **kw))


def build_once(path: Path, build: Any) -> Path:
    """``build(folder)`` into ``path`` unless it holds a model already; returns ``path``.

    The folder appears atomically (built aside, then renamed), so concurrent test workers never see half a model.
    """
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        build(staging)
        os.rename(staging, path)
    except OSError:
        if not (path / "config.json").exists():  # a concurrent builder did not win the race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
