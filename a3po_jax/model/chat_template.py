"""The ChatML chat template (model layer): how a conversation becomes one prompt string.

It belongs to the tokenizers, so it lives here: `char_tokenizer` installs it, and
`a3po_jax.tasks.render_prompt` falls back to it for a tokenizer with no template of its own.
"""

# SmolLM2 and Qwen use this format; `<|im_start|>`/`<|im_end|>` are only special tokens if
# the tokenizer has them.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
